"""``depctl draft train``: an EAGLE-3 draft head for a target, trained from the target's own answers.

The training runs in a process of its own (``python -m depctl_runtime.training``, as the daemon runs in its own);
this command starts it, draws its JSON progress lines, and passes Ctrl-C on so that it saves before it stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import typing
from pathlib import Path
from typing import Optional

import typer

from depctl import config, models, output, recordings
from depctl.cli._common import DEVICE_HELP, handle_errors
from depctl.errors import DepctlError, UsageError
from depctl.spec import Quantization, check_quantization
from depctl.store import SpecStore

app = typer.Typer(help="Draft heads trained for a target (EAGLE-3).", no_args_is_help=True)


@app.command()
@handle_errors
def train(
    target: str = typer.Argument(
        ..., metavar="TARGET", help="The model the head drafts for (alias, directory, .gguf)."
    ),
    out: Path = typer.Option(..., "--out", metavar="DIR", help="Where the head is written (speculators format)."),
    data: Optional[Path] = typer.Option(
        None,
        "--data",
        metavar="FILE.jsonl",
        help='Prompts ({"prompt": ...}) or conversations ({"messages": [...]}), one a line; the target answers '
        "them. Default: the prompt set that ships with depctl (chat, instructions, code).",
    ),
    from_deployment: Optional[str] = typer.Option(
        None,
        "--from-deployment",
        metavar="ID",
        help="Train on the prompts deployment ID has served (it records them with --record-prompts).",
    ),
    minutes: float = typer.Option(
        30.0, "--minutes", metavar="MINUTES", min=0.1, help="The whole run's time budget, answers included."
    ),
    draft_vocab: int = typer.Option(
        4096, "--draft-vocab", metavar="N", min=16, help="Tokens the head predicts: the answers' most frequent."
    ),
    steps: int = typer.Option(
        4, "--steps", metavar="K", min=1, max=16, help="Draft steps the head is for: held-out acceptance is at K."
    ),
    train_steps: Optional[int] = typer.Option(
        None,
        "--train-steps",
        metavar="N",
        min=1,
        max=16,
        help="Chained draft steps trained (training-time test), at most K: fewer train more positions a minute. "
        "Default: 2, or K if smaller.",
    ),
    max_tokens: int = typer.Option(
        192, "--max-tokens", metavar="N", min=8, help="Longest answer generated per prompt."
    ),
    samples: int = typer.Option(
        8,
        "--samples",
        metavar="N",
        min=1,
        max=32,
        help="Answers per prompt: one greedy, the rest sampled (more to learn from), as many as 40% of --minutes "
        "allows.",
    ),
    written_requests: bool = typer.Option(
        True,
        "--written-requests/--no-written-requests",
        help="Once every prompt's answers are under way, spend the rest of the answering share on requests the "
        "target writes itself in its chat template's user turn (more kinds of requests to learn from).",
    ),
    device: str = typer.Option("auto", "--device", metavar="[auto|cpu|cuda]", help=DEVICE_HELP),
    quantization: Optional[str] = typer.Option(
        None,
        "--quantization",
        metavar="[none|int8|int4]",
        help="The target's weights while it answers: the --quantization the head's deployment will use, so the head "
        "learns the features it will read. Default: the recorded deployment's with --from-deployment, else none.",
    ),
    compile_passes: Optional[bool] = typer.Option(
        None,
        "--compile/--no-compile",
        help="Compile the target's passes to answer faster. Default: when a library for it is already built, or "
        "when --minutes is 20 or more (building one takes a minute or more of the budget on 2 cores).",
    ),
    force: bool = typer.Option(
        False, "--force", help="Write into --out even though it holds something other than a head of TARGET."
    ),
) -> None:
    """Train an EAGLE-3 head for TARGET from its own answers; stop with Ctrl-C and run the same command to resume."""
    if data is not None and from_deployment is not None:
        raise UsageError("--data and --from-deployment cannot be used together", "give one of them")
    if from_deployment is not None:
        data = _recorded_prompts(from_deployment, target)
        if quantization is None:
            quantization = SpecStore().get(from_deployment).quantization
    quantization = quantization or "none"
    if train_steps is not None and train_steps > steps:
        raise UsageError(
            f"--train-steps {train_steps} is more than --steps {steps}: the head cannot train steps it never drafts",
            f"give --train-steps {steps} or fewer, or raise --steps",
        )
    train_steps = min(steps, 2) if train_steps is None else train_steps
    if quantization not in typing.get_args(Quantization):
        raise UsageError(f"--quantization {quantization!r} is not one of none, int8, int4", "give one of them")
    try:
        check_quantization(quantization, "auto", device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if data is not None and not data.is_file():
        raise UsageError(f"--data {data}: no such file", 'give a JSONL file of {"prompt": "..."} lines')
    _check_data(data)
    _check_out(out, target, force)  # the last check: nothing is written before every one has passed
    cmd = config.python_module("depctl_runtime.training") + [target, "--out", str(out), "--minutes", str(minutes)]
    cmd += ["--draft-vocab", str(draft_vocab), "--steps", str(steps), "--train-steps", str(train_steps)]
    cmd += ["--max-tokens", str(max_tokens)]
    cmd += ["--samples", str(samples), "--quantization", quantization]
    cmd += ["--device", device] + {None: [], True: ["--compile"], False: ["--no-compile"]}[compile_passes]
    cmd += ["--data", str(data)] if data is not None else []
    cmd += [] if written_requests else ["--no-written-requests"]
    try:
        (out / ".train").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"--out {out}: cannot write there ({exc.strerror})", "give a directory you can write"
        ) from None
    log = out / ".train" / "train.log"  # the libraries' own messages, kept off the progress bar
    with log.open("a") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    run = _Run()
    try:
        with output.progress() as bar:
            task = bar.add_task("starting", total=None)
            for line in proc.stdout:
                run.hear(line, bar, task)
            code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)  # it saves the head and its state, then exits
        for line in proc.stdout:
            run.hear(line)
        proc.wait()
        output.message(run.stopped_message(out))
        raise typer.Exit(130) from None
    result, error = run.result, run.error
    if error:
        raise UsageError(error)
    if code != 0 or result is None:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-5:]).strip()
        raise DepctlError(f"training stopped with exit status {code}: {tail}", f"the whole log is {log}")
    output.message(
        ("Trained ", "bold"),
        f"{out}: {result['minutes']:.1f} min, held-out acceptance by position "
        f"{', '.join(f'{a:.0%}' for a in result['acceptance'])}, mean accepted length {result['mean_accepted']:.2f}",
    )
    output.message(
        f"Serve it: depctl deployment create {target} --draft-model {out} --draft-token-count {steps}  "
        "(vLLM loads the same directory as its eagle3 method)"
    )


class _Run:
    """What the trainer has said so far (one JSON event a line on its stdout), drawn on ``bar`` while it runs."""

    def __init__(self) -> None:
        self.result: dict | None = None
        self.error: str | None = None
        self.trained_minutes = 0.0
        self.answers = 0
        self.measured: dict | None = None  # the last held-out measurement

    def hear(self, line: str, bar=None, task=None) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return  # a library's own print
        kind = event.get("event")
        update = (lambda **fields: bar.update(task, **fields)) if bar is not None else (lambda **fields: None)
        if kind == "stage":
            update(description=event["name"], total=None)
        elif kind == "answers":
            self.answers = event["done"] + event.get("written", 0)
            own = f", {event['written']} requests it wrote" if event.get("written") else ""
            update(
                description=f"the target answers the prompts ({event['tokens']} tokens{own})",
                completed=event["done"],
                total=event["total"],
            )
        elif kind == "resumed":
            self.trained_minutes = event["minutes"]
            update(description=f"resuming after {event['minutes']:.1f} min of training")
        elif kind == "train":
            self.trained_minutes, self.measured = event["minutes"], event
            update(description=_train_line(event), completed=event["minutes"], total=event["total_minutes"])
        elif kind == "progress":
            self.trained_minutes = event["minutes"]
            line = _train_line({**self.measured, "loss": event["loss"]}) if self.measured else "training"
            update(description=line, completed=event["minutes"], total=event["total_minutes"])
        elif kind == "done":
            self.result = event
            self.trained_minutes = event.get("minutes", self.trained_minutes)
        elif kind == "error":
            self.error = event["message"]

    def stopped_message(self, out: Path) -> str:
        if self.trained_minutes > 0:
            return (
                f"Stopped after {self.trained_minutes:.1f} min of training; the head so far is in {out}. "
                "Run the same command to resume."
            )
        kept = f"; the {self.answers} answers generated so far are kept" if self.answers else ""
        return f"Stopped before any training step: nothing was trained{kept}. Run the same command to go on."


def _recorded_prompts(deployment_id: str, target: str) -> Path:
    """The prompts deployment ``deployment_id`` recorded, after checking it serves TARGET and recorded some."""
    spec = SpecStore().get(deployment_id)
    if models.resolve(spec.model, "MODEL") != models.resolve(target, "TARGET"):
        raise UsageError(
            f"--from-deployment {deployment_id} serves {spec.model}, not {target}: a head learns the model it drafts "
            "for from that model's traffic",
            f"depctl draft train {spec.model} --from-deployment {deployment_id} --out DIR",
        )
    if recordings.count(deployment_id) == 0:
        state = "records prompts but has served none yet" if spec.record_prompts else "does not record prompts"
        raise UsageError(
            f"--from-deployment {deployment_id}: the deployment {state}",
            f"turn recording on with `depctl deployment update {deployment_id} --record-prompts`, send it traffic, "
            "then train",
        )
    return recordings.path(deployment_id)


def _train_line(event: dict) -> str:
    acceptance = " ".join(f"{a:.0%}" for a in event["acceptance"])
    loss = f"loss {event['loss']:.2f}, " if event.get("loss") is not None else ""
    return f"training: {loss}held-out acceptance {acceptance}, mean accepted {event['mean_accepted']:.2f}"


def _check_data(data: Path | None) -> None:
    from depctl_runtime.training.data import DataError, load_conversations

    if data is not None:
        try:
            load_conversations(data)
        except DataError as exc:
            raise UsageError(f"--data {data}: {exc}", 'give a JSONL file of {"prompt": "..."} lines') from None


def _check_out(out: Path, target: str, force: bool) -> None:
    """--out must be new, empty, or a head of ``target`` (an earlier run to resume): anything else (a model
    directory, /etc) would have its files replaced."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file", "give a directory: a new one, or a head of this target to resume")
    if not out.exists():
        parent = next(p for p in out.absolute().parents if p.exists())
        if not os.access(parent, os.W_OK):
            raise UsageError(f"--out {out}: {parent} is not writable", "give a directory you can write")
        return
    entries = {p.name for p in out.iterdir()} - {".train"}
    if not entries or force:
        return
    try:
        config = json.loads((out / "config.json").read_text())
        trained_for = config["speculators_config"]["verifier"]["name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"--out {out} is not empty and holds no draft head: training would overwrite its files",
            "give a new directory, or --force to write into this one",
        ) from None
    if trained_for != target:
        raise UsageError(
            f"--out {out} holds a head trained for {trained_for!r}, not {target!r}",
            "give a new directory, or --force to replace that head",
        )
