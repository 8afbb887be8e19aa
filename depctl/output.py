"""The one output sink: data to stdout (table, json or yaml), messages and errors to stderr.

User text (names, paths, reasons, model output) is never read as Rich markup: ``message`` and table cells print a
``str`` literally, so a display name like ``[/]`` or ``[red]x[/red]`` shows as typed. Style comes only from
``(text, style)`` pairs and ``Text`` objects built here and in the commands."""

from __future__ import annotations

import enum
import json
import os
import re
import sys
import threading
import time
from datetime import datetime
from types import SimpleNamespace
from typing import Any, Callable, Union

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

Part = Union[str, tuple[str, str], Text]  # literal text, (text, style), or a styled Text


class Format(str, enum.Enum):
    table = "table"
    json = "json"
    yaml = "yaml"


def out() -> Console:
    console = Console(soft_wrap=False)
    if console.is_terminal:
        return console
    # piped (grep, less, a file): a row stays one line instead of wrapping at Rich's assumed 80 columns, unless
    # COLUMNS asks for a width
    columns = os.environ.get("COLUMNS", "")
    return Console(soft_wrap=False, width=int(columns) if columns.isdigit() and int(columns) > 0 else 240)


def show(renderable: Any) -> None:
    """Print a table or view on stdout; piped, without the spaces Rich pads each line with to the table's width."""
    console = out()
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as captured:
        console.print(renderable)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    sys.stdout.flush()


def err() -> Console:
    return Console(stderr=True, soft_wrap=True)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def emit(data: Any, fmt: Format, table: Callable[[Any], Any]) -> None:
    """Print ``data`` as json/yaml verbatim, or as whatever renderable ``table(data)`` builds."""
    if fmt == Format.json:
        print(json.dumps(_plain(data), indent=2))
    elif fmt == Format.yaml:
        print(yaml.safe_dump(_plain(data), sort_keys=False).rstrip())
    else:
        show(table(data))


def progress() -> Progress | PlainProgress:
    """The one style for long waits (pulls, loads, installs), on stderr: a spinner, what is happening, a bar and a
    percentage where the total is known, the time it has taken. Where stderr is not a terminal (a log, CI, a pipe),
    plain lines instead: one when the step changes, and one each tenth of the way or 5 seconds."""
    console = err()
    if not console.is_terminal:
        return PlainProgress(console)
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class PlainProgress:
    """``Progress``'s calls (``add_task``, ``update``, ``advance``, ``console``) as lines of text: ``[  12s] step
    (40%)``. A line is printed when the step changes (not its counts: "12 MB of 98 MB" is the same step), when a
    tenth of the total more is done, or every 5 seconds of the same step (a log never goes quiet for longer)."""

    EVERY = 5.0

    def __init__(self, console: Console):
        self.console = console
        self._tasks: dict[int, dict] = {}
        self._start = time.monotonic()  # one clock for the whole wait, as the bar's
        self._lock = threading.Lock()  # the ticker and the caller both print

    def __enter__(self) -> PlainProgress:
        # a step that calls no update for a while (a library's long call) still gets its line every EVERY seconds
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="depctl-progress", daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._ticker.join(timeout=2)

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            for task in list(self._tasks):
                self._say(task)

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        task = max(self._tasks, default=-1) + 1
        self._tasks[task] = {"description": description, "total": total, "completed": 0.0, "start": self._start}
        self._tasks[task]["said"] = None
        self._say(task)
        return task

    def update(self, task: int, description: str | None = None, completed=None, total=None, advance=None, **_):
        state = self._tasks[task]
        if description is not None:
            state["description"] = description
        if total is not None:
            state["total"] = total
        if completed is not None:
            state["completed"] = completed
        if advance is not None:
            state["completed"] += advance
        self._say(task)

    @property
    def tasks(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(total=t["total"]) for t in self._tasks.values()]

    def remove_task(self, task: int) -> None:
        self._tasks.pop(task, None)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def _say(self, task: int) -> None:
        with self._lock:
            self._say_locked(task)

    def _say_locked(self, task: int) -> None:
        state = self._tasks.get(task)
        if state is None:
            return
        now = time.monotonic()
        total = state["total"]
        tenth = int(10 * state["completed"] / total) if total else None
        step = re.sub(r"\d[\d.,]*", "#", state["description"])  # counts in a step's text are not a new step
        said = state["said"]
        if said is not None and said[0] == step and said[1] == tenth and now - said[2] < self.EVERY:
            return
        state["said"] = (step, tenth, now)
        done = f" ({min(state['completed'] / total, 1.0):.0%})" if total else ""
        line = f"[{now - state['start']:5.0f}s] {state['description']}{done}"
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


def message(*parts: Part) -> None:
    err().print(Text.assemble(*parts), highlight=False)


class LiteralTable(Table):
    """A table whose ``str`` cells are shown as typed (never parsed as markup); pass ``Text`` for style."""

    def add_row(self, *cells, **kwargs) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kwargs)


def make_table(*columns: str, title: str | None = None, whole: int = 1) -> Table:
    """A borderless table; its first ``whole`` columns (ids, names) never break mid-word, the rest wrap at spaces."""
    table = LiteralTable(title=title, header_style="bold", box=None, pad_edge=False)
    for i, column in enumerate(columns):
        table.add_column(column, no_wrap=i < whole, overflow="fold")
    return table


def make_grid() -> Table:
    grid = LiteralTable.grid(padding=(0, 2))
    return grid


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def fmt_num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_bytes(n: int | None) -> str:
    """Binary units, named as such (a 98 MB download is 93.8 MiB: two names for one size confused)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], width: int, top: float | None = None) -> str:
    """The last ``width`` values as block characters scaled to ``top`` (default: their maximum); None is a gap."""
    values = values[-width:]
    known = [v for v in values if v is not None]
    top = top if top is not None else max(known, default=0.0)
    if top <= 0:
        return " " * (width - len(values)) + "".join(" " if v is None else BLOCKS[0] for v in values)
    cells = [" " if v is None else BLOCKS[min(int(v / top * (len(BLOCKS) - 1) + 0.5), len(BLOCKS) - 1)] for v in values]
    return " " * (width - len(values)) + "".join(cells)


def bar(value: float, top: float, width: int) -> str:
    """A horizontal bar of ``value`` out of ``top`` in ``width`` cells (eighths at the tip)."""
    eighths = round(max(value, 0.0) / top * width * 8) if top > 0 else 0
    full, rest = divmod(min(eighths, width * 8), 8)
    return "█" * full + ("▏▎▍▌▋▊▉"[rest - 1] if rest else "")
