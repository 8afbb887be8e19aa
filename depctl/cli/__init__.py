"""The ``depctl`` command line: deployments, the daemon, models, and talking to deployments."""

from __future__ import annotations

import typer

from depctl import __version__
from depctl.cli import bench, chat, daemon, deployment, draft, engine, model, top


def _plain_arguments() -> None:
    """Typer 0.2x writes a required argument as ``{ID}`` in usage lines and adds its Python type in the help
    (``ID <str>``); depctl's usage reads ``depctl deployment get ID``, as click, firectl and git write it."""
    from typer.core import TyperArgument

    def usage(self) -> str:
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return name + ("..." if self.nargs != 1 else "")

    if hasattr(TyperArgument, "_usage_display_name"):
        TyperArgument._usage_display_name = usage
    TyperArgument.display_type_rich = lambda self, ctx: None


_plain_arguments()
app = typer.Typer(
    rich_markup_mode=None,
    name="depctl",
    help="Local speculative-decoding deployments: create them, serve them over an OpenAI-compatible API, "
    "see the speedup.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
deployment.app.command()(bench.bench)
app.add_typer(deployment.app, name="deployment")
app.add_typer(daemon.app, name="daemon")
app.add_typer(model.app, name="model")
app.add_typer(engine.app, name="engine")
app.add_typer(draft.app, name="draft")
app.command()(chat.generate)
app.command()(chat.chat)
app.command()(top.ps)
app.command()(top.top)
app.command()(daemon.serve)


def _version(value: bool) -> None:
    if value:
        import platform
        from importlib import metadata

        try:
            torch = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch = "not installed"
        typer.echo(f"depctl {__version__} (torch {torch}, Python {platform.python_version()})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print depctl's version and exit."
    ),
) -> None:
    pass


def main() -> None:
    app()
