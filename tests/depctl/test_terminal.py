"""``depctl chat`` and ``depctl top`` in a real terminal: tmux runs them, the test types keys and reads the screen."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl.store import SpecStore
from tests.daemon_util import DaemonProcess
from tests.tiny import LONG, LONG_ANSWER, save_tiny
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.slow,  # a daemon in a subprocess and terminals driven through tmux
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed: no terminal to drive"),
]


class Terminal:
    """One tmux session on a server of its own, 120x40 (or ``width`` columns), running ``command`` and then saying
    how it exited."""

    def __init__(self, command: str, env: dict, width: int = 120):
        self.socket = f"depctl-test-{os.getpid()}-{time.monotonic_ns()}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # the tmux server inherits this process's environment: a COLUMNS there (pytest's terminal) would override
        # the window's size
        script = f"unset COLUMNS LINES; export {exports}; {command}; echo EXITED $?; sleep 60"
        self._tmux("new-session", "-d", "-s", "t", "-x", str(width), "-y", "40", script)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True, timeout=30
        ).stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never showed; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("terminal-home")
    SpecStore(home / "deployments").create(
        DeploymentSpec(
            id="t",
            model=str(tiny_model_dir),
            compile=False,
            speculation=NgramSpeculation(ngram_length=2, num_draft_tokens=4),
        )
    )
    # room for an answer long enough to stop halfway (a random tiny model rarely ends on its own)
    long_context = save_tiny(tmp_path_factory.mktemp("terminal-long"), seed=0, max_positions=LONG)
    SpecStore(home / "deployments").create(DeploymentSpec(id="long", model=str(long_context), compile=False))
    daemon = DaemonProcess(home).start()
    daemon.wait_state("t")
    daemon.wait_state("long")
    yield daemon
    daemon.stop()


def _env(daemon) -> dict:
    return {"DEPCTL_HOME": str(daemon.home), "PATH": os.environ["PATH"], "TERM": "xterm-256color"}


def test_chat_edits_lines_keeps_history_stops_answers_and_leaves_on_bye(served):
    term = Terminal(f"{shlex.quote(sys.executable)} -m depctl chat t --max-tokens 40", _env(served))
    try:
        term.wait_for(">>>")
        term.keys("helo", "BSpace", "lo there", "Enter")  # line editing: the typo is gone before it is sent
        screen = term.wait_for("tokens in")
        assert ">>> hello there" in screen and "helo" not in screen.replace("hello", "")
        term.keys('"""first line', "Enter", 'second line"""', "Enter")  # a multi-line message
        term.wait_for("... second line")
        deadline = time.monotonic() + 60
        while term.screen().count("tokens in") < 2:
            assert time.monotonic() < deadline, term.screen()
            time.sleep(0.2)
        term.keys("C-c")  # at the prompt: says how to leave, and stays
        term.wait_for("Use Ctrl-D or /bye to leave.")
        term.keys("Up")  # the history: the last message comes back for editing
        term.wait_for('>>> second line"""')
        term.keys("C-u", "/bye", "Enter")  # a command, never sent to the model
        screen = term.wait_for("EXITED 0")
        assert screen.count("tokens in") == 2
    finally:
        term.close()


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(served):
    term = Terminal(f"{shlex.quote(sys.executable)} -m depctl chat long --max-tokens {LONG_ANSWER}", _env(served))
    try:
        term.wait_for(">>>")
        term.keys("go on and on", "Enter")
        wait_until(  # the answer is being written
            lambda: served.get("/depctl/v1/deployments/long").json()["num_requests_running"] == 1, "the answer to start"
        )
        term.keys("C-c")
        screen = term.wait_for("(stopped)")
        assert "tokens in" not in screen  # it never ran to its end
        term.keys("/clear", "Enter")
        term.wait_for("Cleared the conversation.")  # still chatting
        term.keys("C-d")
        term.wait_for("EXITED 0")
    finally:
        term.close()


def test_top_draws_a_live_row_per_deployment_and_quits_on_ctrl_c(served):
    term = Terminal(f"{shlex.quote(sys.executable)} -m depctl top --interval 0.5", _env(served))
    try:
        term.wait_for("depctl top")
        body = {"model": "t", "prompt": "abcabcabc", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        for _ in range(3):
            assert served.post("/v1/completions", body).status_code == 200
        deadline = time.monotonic() + 30
        while True:  # a non-zero rate and a sparkline cell above the floor once the meter has seen the requests
            rows = [line for line in term.screen().splitlines() if line.startswith("t ")]
            if rows and any(block in rows[0] for block in "▂▃▄▅▆▇█"):
                break
            assert time.monotonic() < deadline, term.screen()
            time.sleep(0.3)
        assert "READY" in rows[0] and "TOK/S" in term.screen()
        term.keys("C-c")
        term.wait_for("EXITED 0")
    finally:
        term.close()


def test_top_and_ps_read_cleanly_at_80_columns(served):
    """80 columns: every header whole and one line per deployment (sparklines only where they fit)."""
    term = Terminal(f"{shlex.quote(sys.executable)} -m depctl top --interval 0.5", _env(served), width=80)
    try:
        screen = term.wait_for("READY")
        header = next(line for line in screen.splitlines() if line.startswith("ID "))
        assert {"ID", "STATE", "RUN/WAIT", "TOK/S", "ACCEPT", "CACHED", "MEMORY"} <= set(header.split()), screen
        assert "…" not in screen and [line for line in screen.splitlines() if line.startswith("t ")], screen
        term.keys("C-c")
        term.wait_for("EXITED 0")
    finally:
        term.close()
    term = Terminal(f"{shlex.quote(sys.executable)} -m depctl ps", _env(served), width=80)
    try:
        screen = term.wait_for("EXITED 0")
        lines = screen.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("ID "))
        names = ["ID", "STATE", "RUN", "WAIT", "TOK/S", "ACCEPT", "CACHED", "MEMORY", "MODEL"]
        assert lines[header].split() == names, screen
        rows = [line.split() for line in lines[header + 1 : header + 3]]
        assert sorted(row[:2] for row in rows) == [["long", "READY"], ["t", "READY"]], screen
        assert all(row[-1].endswith("…") for row in rows), screen
        assert "daemon pid" in " ".join(lines[header + 3 : header + 5]), screen  # the caption may wrap at 80
    finally:
        term.close()
