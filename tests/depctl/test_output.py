"""What the CLI prints: piped tables without Rich's padding and at the width COLUMNS asks for, and plain progress
lines where stderr is not a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from depctl import output
from depctl.cli import app
from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl.store import SpecStore


def test_a_piped_table_has_no_padding_and_takes_columns_from_the_environment(monkeypatch, capsys):
    table = output.make_table("NAME", "MODEL")
    table.add_row("a", "short")
    table.add_row("a-much-longer-name", "x" * 150)
    monkeypatch.delenv("COLUMNS", raising=False)
    output.show(table)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line == line.rstrip() for line in lines)
    assert lines[1].split() == ["a", "short"], "a row stays one line, as long as it is"
    monkeypatch.setenv("COLUMNS", "80")
    output.show(table)
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 and line == line.rstrip() for line in lines) and len(lines) > 3


@pytest.mark.parametrize(
    "args", [("deployment", "list"), ("deployment", "get", "chat"), ("model", "list"), ("engine", "list")]
)
def test_every_table_command_piped_at_80_columns_pads_no_line(args, monkeypatch):
    SpecStore().create(
        DeploymentSpec(
            id="chat", model="smollm2-135m-instruct", speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4)
        )
    )
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines and all(line == line.rstrip() and len(line) <= 80 for line in lines), result.stdout


def test_progress_off_a_terminal_prints_a_line_per_step_and_tenth_not_per_update():
    sink = io.StringIO()
    bar = output.PlainProgress(Console(file=sink, width=200))
    task = bar.add_task("resolving smollm2-135m-instruct", total=None)
    for done in range(0, 101):  # "12 MB of 98 MB" changes on every update: the same step
        bar.update(task, description=f"downloading smollm2 ({done} MB of 100 MB)", completed=done, total=100)
    bar.update(task, description="converting smollm2", completed=0, total=None)
    lines = sink.getvalue().splitlines()
    assert lines[0].endswith("] resolving smollm2-135m-instruct")
    downloads = [line for line in lines if "downloading" in line]
    assert 10 <= len(downloads) <= 12 and downloads[-1].endswith("(100 MB of 100 MB) (100%)")
    assert "] converting smollm2" in lines[-1]


def test_progress_off_a_terminal_never_goes_quiet_during_a_long_call(monkeypatch):
    """A step that calls no update (a library's long call) still gets a line every EVERY seconds."""
    import time

    monkeypatch.setattr(output.PlainProgress, "EVERY", 0.2)
    sink = io.StringIO()
    with output.PlainProgress(Console(file=sink, width=200)) as bar:
        bar.add_task("converting smollm2: reading the tokenizer", total=None)
        time.sleep(3.2)
    lines = sink.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.endswith("] converting smollm2: reading the tokenizer") for line in lines)
