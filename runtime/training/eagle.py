"""``depctl draft train``: an EAGLE-3 head for a target, trained from the target's own answers, on a CPU or a GPU.

EAGLE-3's recipe (Li et al. 2025, arXiv 2503.01840), sized for a laptop:

1. **Answers and hidden states**: the target answers every prompt through depctl's own engine (batched, speculation
   off): one greedy answer, then sampled ones, so the head learns what this target says; time left in the answering
   share answers requests the target writes itself (``WrittenRequests``). The outputs of three layers
   (low, middle, high) at every position are kept as the engine computes them, the same features a deployment will
   hand the head. Cached in ``OUT/.train/answers-N.safetensors``.
2. **Vocabulary**: the head predicts over the ``--draft-vocab`` tokens the answers use most (``d2t`` maps them back).
3. **Training-time test**: the head runs ``--train-steps`` chained draft steps over every answer, each step reading
   its own previous output as drafting will (``EagleHead.ttt_logits``); cross-entropy against the target's
   distribution, step j weighted 0.8^j. A held-out tenth of the prompts measures acceptance at ``--steps`` (the K
   the head is for) as training goes.

Progress goes to stdout as JSON lines (the CLI draws them); the head is saved in the speculators format at every
evaluation, so an interrupted run leaves a usable head, and the same command resumes it (``OUT/.train/state.*``)
until ``--minutes`` of training in total.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import signal
import sys
import time
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from depctl.spec import Quantization
from depctl_runtime.model import eagle_format
from depctl_runtime.model.eagle import EagleConfig, EagleHead
from depctl_runtime.training.answers import MAX_WRITTEN, WRITE_TEMPERATURE, user_turn
from depctl_runtime.training.data import DataError, load_conversations
from depctl_runtime.training.state import load_rows, load_state, save_rows, save_state
from depctl_runtime.training.traffic import MIN_ANSWER, Top

STEP_WEIGHT = 0.8  # EAGLE-3's decay: later draft steps matter less (they are reached less often)
SAMPLE_TEMPERATURE = 0.8  # sampled answers: other likely paths, still the target's own
# a position whose distribution's top tokens in the draft vocabulary carry less than this of it teaches nothing: the
# target's likely tokens are never drafted there
SOFT_MASS = 0.05
GENERATION_SHARE = 0.4  # answers stop being generated once this share of the budget is spent
MIN_EXAMPLES = 10  # below this there is no meaningful held-out split
COMPILE_WORTH_MINUTES = 20  # a budget this long pays for building compiled passes (minutes on 2 cores)
# the recipe of offline and learning heads alike: two chained draft steps (the training-time test's depth) into the
# 4,096 tokens the answers use most (about 90% of chat answers' tokens; 8,192: 94%) train three times the positions a
# CPU-minute of four into 8,192 (the output layer is half a training step), and reach more acceptance at K=4 in the
# same minutes (BENCHMARKS.md, "Two chained steps into 4,096 tokens for")
TRAIN_STEPS = 2
DRAFT_VOCAB = 4096
BATCH_ROWS = 512  # positions whose gradients make one optimizer step
# in bf16 on a CPU an answer's positions are padded to a multiple of this: oneDNN builds its bf16 products for each
# shape, and at every answer's own length a step took 2.1x its float32 time, padded 0.83x (benchmarks/train_step.py)
SHAPE_BUCKET = 32
EVALUATE_EVERY = 60.0  # seconds of training between held-out measurements


@dataclass
class TrainOptions:
    target: str
    out: Path
    data: Path | None = None
    minutes: float = 30.0
    draft_vocab: int = DRAFT_VOCAB
    steps: int = 4  # the K the head is for: held-out acceptance is measured at it, and the head's config says it
    train_steps: int = TRAIN_STEPS  # chained draft steps trained (at most ``steps``)
    max_tokens: int = 192
    # answers per prompt: one greedy, the rest sampled; the answers' share of the budget cuts them where the target is
    # slow. Three of the shipped prompts' were learned by minute 15 and the rest overfitted them
    # (BENCHMARKS.md, "Eight answers a prompt, a step per 512 positions")
    samples: int = 8
    batch: int = 16
    lr: float = 5e-4
    device: str = "auto"
    quantization: str = "none"  # the target's weights while it answers: train at the precision it will serve
    # compiled passes answer faster, but the first build for a model (with the head's layers) takes minutes: None
    # builds one only for a budget of COMPILE_WORTH_MINUTES or more, and otherwise uses one only if it exists
    compile: bool | None = None
    heldout: float = 0.1
    seed: int = 0
    train_dtype: str = "auto"  # the products of a training step: "auto" is bf16 where the hardware multiplies it
    # once the given prompts' answers are under way, the answering share's time left answers requests the target
    # writes itself (``WrittenRequests``)
    written: bool = True
    prompt_positions: bool = False  # the prompts' tokens are labels too (their features are kept anyway)
    freeze_output: bool = False  # the output layer and final norm stay the target's own
    answer_share: float = GENERATION_SHARE  # of the budget, answering's at most (the rest trains)
    average: float = 0.0  # a running average of the weights, per optimizer step, is measured and saved (0: none)
    feature_noise: float = 0.0  # training's features get Gaussian noise of this size relative to theirs (``noisy``)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay


def training_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """The dtype of a training step's products: bf16 where the hardware multiplies it (AVX-512 BF16 or AMX, a GPU
    with bf16) or where asked, else float32. The weights, AdamW's moments and the loss stay float32 either way."""
    if requested == "auto":
        from depctl_runtime.backends.precision import cpu_has_bf16

        bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_bf16()
        return torch.bfloat16 if bf16 else torch.float32
    return torch.bfloat16 if requested == "bfloat16" else torch.float32


def trainable(head: EagleHead, freeze_output: bool = False) -> list[torch.nn.Parameter]:
    """The head's parameters a training step updates: all but the target's input embeddings, and with
    ``freeze_output`` all but the output layer and final norm too (they stay the target's own rows, as EAGLE-1 and -2
    kept the target's head)."""
    if freeze_output:
        head.lm_head.weight.requires_grad_(False)
        head.norm.weight.requires_grad_(False)
    return [p for n, p in head.named_parameters() if not n.startswith("embed_tokens") and p.requires_grad]


def averaged(head: EagleHead) -> EagleHead:
    """A copy of ``head`` to hold the running average of its weights (Polyak averaging), sharing its frozen
    embeddings."""
    average = copy.deepcopy(head, {id(head.embed_tokens): head.embed_tokens})
    return average.requires_grad_(False).eval()


def average_pairs(average: EagleHead, head: EagleHead) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(average, weight) for every weight of ``head`` a training step updates (``trainable``'s)."""
    weights = dict(head.named_parameters())
    return [
        (kept, weights[name])
        for name, kept in average.named_parameters()
        if not name.startswith("embed_tokens") and weights[name].requires_grad
    ]


@torch.no_grad()
def average_step(pairs: list[tuple[torch.Tensor, torch.Tensor]], decay: float, steps: int | None) -> None:
    """After optimizer step number ``steps``: each (average, weight) pair moves towards the weight. A new head's
    first steps' weights are far from where training goes: a shorter memory until about ``1 / (1 - decay)`` steps
    (``steps`` None: the full memory from the first, for weights trained already)."""
    if steps is not None:
        decay = min(decay, (1 + steps) / (10 + steps))
    for kept, param in pairs:
        kept.lerp_(param, 1 - decay)


def adamw(params: list, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW (by default without weight decay), as one fused kernel over every parameter where PyTorch has one for
    the device."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # a device without a fused AdamW
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def noisy(features: torch.Tensor, scale: float, layers: int) -> torch.Tensor:
    """``features`` [T, layers * hidden] with Gaussian noise added, ``scale`` times each position's root mean square
    in each layer's part (the layers' states differ in size): EAGLE's augmentation against a head learning its
    answers' states by heart."""
    parts = features.unflatten(-1, (layers, -1))
    size = parts.pow(2).mean(-1, keepdim=True).sqrt()
    return (parts + scale * size * torch.randn_like(parts)).flatten(-2)


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class Stop(Exception):
    """SIGINT or SIGTERM: save and leave."""


def train(opts: TrainOptions) -> dict:
    from depctl_runtime.backends.precision import pick_device
    from depctl_runtime.backends.weights import LoadError, resolve_source

    torch.manual_seed(opts.seed)
    state_dir = opts.out / ".train"
    state_dir.mkdir(parents=True, exist_ok=True)
    conversations = load_conversations(opts.data)
    if len(conversations) < MIN_EXAMPLES:
        raise DataError(
            f"{len(conversations)} examples are too few to hold some out for measuring acceptance; give at least "
            f"{MIN_EXAMPLES} (a few hundred train a useful head)"
        )
    try:
        source = resolve_source(opts.target, "TARGET", lambda stage: emit("stage", name=str(stage)))
    except LoadError as exc:
        raise DataError(str(exc)) from None
    device = pick_device(opts.device)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"TARGET {opts.target!r} has no chat template, so its answers to prompts cannot be generated; train a "
            "head for an instruction-tuned model"
        )
    started = time.monotonic()
    budget = opts.minutes * 60
    config = EagleConfig.for_target(AutoConfig.from_pretrained(source), opts.draft_vocab)
    rng = random.Random(opts.seed)
    held = heldout_prompts(len(conversations), opts.heldout, rng)
    examples = _answers(
        opts, tokenizer, conversations, config.aux_layers, state_dir, started, budget * opts.answer_share, held
    )
    if len(examples) < MIN_EXAMPLES:
        raise DataError(f"only {len(examples)} answers were generated in the time given; raise --minutes")
    model = _reference_model(source)
    verifier = {
        "name_or_path": opts.target,
        "architectures": list(getattr(model.config, "architectures", None) or []),
        "fingerprint": eagle_format.fingerprint(model),
    }
    embeddings = model.get_input_embeddings().weight.detach().float().clone()
    output_layer = model.get_output_embeddings().weight.detach().float()  # [vocab, hidden]
    final_norm = model.model.norm.weight.detach().float()
    del model

    heldout = [e for e in examples if e["index"] in held and e["sample"] == 0]  # greedy answers: what K drafts face
    training = [e for e in examples if e["index"] not in held]
    rng.shuffle(training)

    head = EagleHead(config).to(device)
    head.embed_tokens.weight.data = embeddings.to(device)
    head.embed_tokens.weight.requires_grad_(False)
    head.set_vocabulary(_vocabulary(training, config.draft_vocab_size, config.vocab_size))
    with torch.no_grad():  # start from the target's own output space: its output rows and final norm
        head.lm_head.weight.copy_(output_layer[head.target_ids.cpu()].to(device))
        head.norm.weight.copy_(final_norm.to(device))
    del output_layer
    params = trainable(head, opts.freeze_output)
    optimizer = adamw(params, opts.lr, opts.weight_decay)
    average = averaged(head) if opts.average else None
    pairs = average_pairs(average, head) if average is not None else []
    served = head if average is None else average  # what is measured and saved
    trained, history, seen, optimizer_steps = 0.0, [], 0, 0
    total = max(0.0, opts.minutes * 60 - (time.monotonic() - started))  # answers and hidden states count too
    saved = load_state(state_dir, device)
    if saved is not None:  # resume: the same head, optimizer and clock
        head_state, optimizer_state, state = saved
        if state.get("fingerprint") == verifier["fingerprint"] and state.get("config") == config.to_dict():
            head.load_state_dict({k: v for k, v in head_state.items() if not k.startswith("average.")})
            if average is not None:  # (a state kept without one starts it from the weights)
                kept = {k.removeprefix("average."): v for k, v in head_state.items() if k.startswith("average.")}
                average.load_state_dict(kept or head.state_dict(), strict=False)
            optimizer.load_state_dict(optimizer_state)
            trained, history, seen = state["trained_seconds"], state["history"], state["seen"]
            optimizer_steps = state.get("optimizer_steps", 0)
            total = state["train_seconds"] + (opts.minutes - state["minutes"]) * 60  # a larger --minutes: longer
            emit("resumed", minutes=round(trained / 60, 2))
    if trained >= total:
        emit("stage", name=f"already trained for {trained / 60:.1f} minutes; raise --minutes to train longer")

    def save() -> None:
        extra = {
            "trained_minutes": round(trained / 60, 2),
            "train_steps": min(opts.train_steps, opts.steps),
            "history": history,
            "examples": len(examples),
            "target_quantization": opts.quantization,
        }
        eagle_format.save(served, opts.out, verifier, opts.steps, extra)
        info = {
            "optimizer_steps": optimizer_steps,
            "trained_seconds": trained,
            "train_seconds": total,
            "minutes": opts.minutes,
            "history": history,
            "seen": seen,
            "fingerprint": verifier["fingerprint"],
            "config": config.to_dict(),
        }
        tensors = head.state_dict()
        if average is not None:
            tensors |= {f"average.{k}": v for k, v in average.state_dict().items() if k != "embed_tokens.weight"}
        save_state(state_dir, tensors, optimizer.state_dict(), info)

    warmup = min(30.0, total * 0.05)
    last_eval, running_loss, stopped = time.monotonic(), None, False
    last_said = 0.0
    steps = min(opts.train_steps, opts.steps)
    dtype = training_dtype(device, opts.train_dtype)
    precision = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    bucket = SHAPE_BUCKET if dtype == torch.bfloat16 and device.type == "cpu" else 0
    # a prompt's own tokens are learned once (from its greedy answer's example), from where prompts differ: the
    # template's opening of the user turn is the same in every one
    turn = user_turn(tokenizer, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt_from = len(turn[0]) if turn else 2
    summed, rows = 0.0, 0  # the loss and positions whose gradients wait for the next optimizer step
    emit("stage", name="training the head (held-out acceptance measured each minute)")
    try:
        head.train()
        clock = time.monotonic()
        while trained < total:
            example = training[seen % len(training)]
            seen += 1
            with precision:
                labelled = prompt_from if opts.prompt_positions and example["sample"] == 0 else None
                loss, counted = _loss(head, example, steps, bucket, labelled, opts.feature_noise)
            if counted:
                (loss / BATCH_ROWS).backward()
                summed, rows = summed + float(loss.detach()), rows + counted
            if rows >= BATCH_ROWS:  # one step a batch of positions: a step per answer spent a fifth of it in AdamW
                progress = trained / total
                ramp = min(1.0, trained / warmup) if warmup else 1.0
                for group in optimizer.param_groups:
                    group["lr"] = opts.lr * max(ramp, 0.01) * 0.5 * (1 + math.cos(math.pi * progress))
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                optimizer_steps += 1
                if average is not None:
                    average_step(pairs, opts.average, optimizer_steps)
                value = summed / rows / sum(STEP_WEIGHT**j for j in range(steps))  # a step's cross-entropy
                running_loss = value if running_loss is None else 0.9 * running_loss + 0.1 * value
                summed, rows = 0.0, 0
            now = time.monotonic()
            trained += now - clock
            clock = now
            if now - last_said > 5:  # between the minute's measurements: how far, and the loss
                emit("progress", minutes=round(trained / 60, 2), total_minutes=round(total / 60, 2), loss=running_loss)
                last_said = now
            if now - last_eval > EVALUATE_EVERY or trained >= total:
                history.append(
                    {
                        **_evaluate(served, heldout, opts.steps, trained, running_loss),
                        "epochs": round(seen / len(training), 2),
                    }
                )
                emit("train", **history[-1], total_minutes=round(total / 60, 2))
                save()
                last_eval = clock = time.monotonic()
    except Stop:
        stopped = True
        if trained > 0:
            history.append(
                {
                    **_evaluate(served, heldout, opts.steps, trained, running_loss),
                    "epochs": round(seen / len(training), 2),
                }
            )
            save()
    if not history:
        history.append(_evaluate(served, heldout, opts.steps, trained, None))
        save()
    result = {"out": str(opts.out), "stopped": stopped, **history[-1], "examples": len(examples)}
    emit("done", **result)
    return result


# ---- answers -----------------------------------------------------------------------------------------------------


def _answers(
    opts, tokenizer, conversations, layers, state_dir: Path, started: float, limit: float, held: set[int]
) -> list[dict]:
    """The target's answers with its layer features, generated once and cached: for every conversation its greedy
    answer, then ``opts.samples - 1`` answers sampled at ``SAMPLE_TEMPERATURE`` (other paths through the same prompts:
    more of the target's states to learn from). Greedy answers go first, so a short budget cuts samples, not prompts.
    The features are those depctl's engine computed while answering (``capture.FeatureRecorder``), at the precision a
    deployment of the target runs; cached in ``.train/answers-N.safetensors`` shards, so a resume reads them back."""
    done: dict[tuple[int, int], dict] = {}
    shards = sorted(state_dir.glob("answers-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    for shard in shards:
        try:
            for row in load_rows(shard):
                done[(row["index"], row["sample"])] = row
        except Exception:  # noqa: BLE001 - a shard cut short by an interrupt: its answers are generated again
            shard.unlink(missing_ok=True)
    # a held-out prompt's greedy answer is all acceptance is measured on: its samples would never be read
    todo = [
        (i, s)
        for s in range(opts.samples)
        for i in range(len(conversations))
        if (i, s) not in done and not (s and i in held)
    ]
    given = sum(i < len(conversations) for i, _ in done)  # answers to the given prompts, then to written requests
    wanted, answered_written = given + len(todo), len(done) - given
    if todo and (time.monotonic() - started < limit or len(done) < MIN_EXAMPLES):
        from depctl.spec import DeploymentSpec, NoSpeculation
        from depctl_runtime.backends.loader import load_deployment
        from depctl_runtime.speculation import GenerationParams, SamplingParams, Scheduler, SpeculativeEngine
        from depctl_runtime.training.capture import FeatureRecorder

        emit("stage", name="loading the target to answer the prompts")
        spec = DeploymentSpec(
            id="draft-train",
            model=opts.target,
            speculation=NoSpeculation(),
            max_batch_size=opts.batch,
            device=opts.device,
            quantization=opts.quantization,
            compile=opts.compile is not False,
        )
        build = opts.compile is True or (opts.compile is None and opts.minutes >= COMPILE_WORTH_MINUTES)
        loaded = load_deployment(
            spec,
            calibrate=False,
            report=lambda stage: emit("stage", name=str(stage)),
            features=tuple(layers),
            build_passes=build,
        )
        if not build and loaded.compiled.startswith("no"):
            emit(
                "stage",
                name=f"answering with eager passes: compiling them for this model takes minutes of a "
                f"{opts.minutes:g}-minute budget (--compile builds them; later runs reuse them)",
            )
        recorder = FeatureRecorder()
        engine = SpeculativeEngine(loaded.engine.target, recorder, loaded.engine.config)
        scheduler = Scheduler(engine, max_batch_size=opts.batch)
        pending, fresh = {}, []
        number = int(shards[-1].stem.split("-")[1]) + 1 if shards else 0

        def flush() -> None:  # one shard per batch of finished answers: an interrupt loses at most those
            nonlocal number
            if fresh:
                save_rows(fresh, state_dir / f"answers-{number}.safetensors")
                number += 1
                fresh.clear()

        def queue(i: int, s: int, prompt: list[int]) -> None:
            sampling = SamplingParams(temperature=SAMPLE_TEMPERATURE, seed=opts.seed * 1000 + s) if s else None
            params = GenerationParams(
                max_tokens=opts.max_tokens, speculate=False, **({"sampling": sampling} if sampling else {})
            )
            seq = engine.new_sequence(prompt, params)
            pending[seq.id] = (i, s, prompt, [])
            scheduler.add(seq)

        for i, s in todo:
            text = tokenizer.apply_chat_template(conversations[i], add_generation_prompt=True, tokenize=False)
            queue(i, s, tokenizer(text, add_special_tokens=False)["input_ids"])
        turn = user_turn(tokenizer, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
        requests = WrittenRequests(turn, opts.seed) if opts.written and turn is not None else None
        writing: dict[int, list[int]] = {}  # requests being written: their tokens so far
        next_index = max([len(conversations) - 1, *(i for i, _ in done)]) + 1  # after the given prompts' indices
        tokens = 0
        try:
            while scheduler.has_work() or (requests and time.monotonic() - started < limit):
                # out of time: finish what runs, start nothing new; but not before enough answers to train on are
                # done or under way, or a slow load would leave none at all
                enough = len(done) + scheduler.num_running >= MIN_EXAMPLES
                if time.monotonic() - started > limit and enough:
                    for seq in list(scheduler.waiting):
                        scheduler.cancel(seq)
                # the given prompts all under way and time left: the target writes requests of its own
                elif requests and not scheduler.num_waiting and len(writing) < max(1, opts.batch // 2):
                    seq = engine.new_sequence(*requests.start())
                    writing[seq.id] = []
                    scheduler.add(seq)
                for seq, out in scheduler.step():
                    if seq.id in writing:
                        writing[seq.id].extend(out.token_ids)
                        if out.finish_reason:
                            recorder.drop(seq.id)
                            prompt = requests.prompt(writing.pop(seq.id))
                            if prompt is not None and time.monotonic() - started < limit:
                                queue(next_index, 0, prompt)
                                next_index += 1
                        continue
                    entry = pending.get(seq.id)
                    if entry is None:
                        continue
                    entry[3].extend(out.token_ids)
                    tokens += len(out.token_ids)
                    if not out.finish_reason:
                        continue
                    i, s, prompt, answer = pending.pop(seq.id)
                    if out.finish_reason == "cancelled" or not answer:
                        recorder.drop(seq.id)
                        continue
                    ids = prompt + answer
                    read = recorder.take(seq.id)
                    n = len(ids) - 1  # positions whose next token is kept (a stop token was read, never kept)
                    done[(i, s)] = {
                        "index": i,
                        "sample": s,
                        "start": len(prompt),
                        "tokens": torch.tensor(ids),
                        "features": read["features"][:n],
                        "top_ids": read["top_ids"][: n - len(prompt) + 1],  # from the prompt's last position
                        "top_logp": read["top_logp"][: n - len(prompt) + 1],
                    }
                    fresh.append(done[(i, s)])
                    if len(fresh) >= 32:
                        flush()
                    if i < len(conversations):
                        given += 1
                    else:
                        answered_written += 1
                    emit("answers", done=given, total=wanted, written=answered_written, tokens=tokens)
        finally:
            flush()
            loaded.release()
    return [done[key] for key in sorted(done)]


class WrittenRequests:
    """Requests the target writes itself once the given prompts are all under way (Magpie, Xu et al. 2024): its chat
    template's opening of a user turn and nothing else, continued by sampling, as the learning head's idle answers
    write theirs (``answers.IdleAnswers``). Held-out prompts stay the given ones, so acceptance measures the same."""

    def __init__(self, turn: tuple[list[int], list[int]], seed: int):
        self.opening, self.closing = turn
        self.seed, self.started = seed, 0

    def start(self) -> tuple[list[int], typing.Any]:
        """The next request's prompt (the turn's opening) and sampling, seeded by its number."""
        from depctl_runtime.speculation import GenerationParams, SamplingParams

        self.started += 1
        sampling = SamplingParams(temperature=WRITE_TEMPERATURE, seed=self.seed * 1_000_003 + self.started)
        return list(self.opening), GenerationParams(max_tokens=MAX_WRITTEN, speculate=False, sampling=sampling)

    def prompt(self, written: list[int]) -> list[int] | None:
        """The answer's prompt: the request closed by the template; None for one too short to ask anything."""
        if len(written) < MIN_ANSWER:
            return None
        return self.opening + written + self.closing


def heldout_prompts(count: int, fraction: float, rng: random.Random) -> set[int]:
    """The indices of the prompts held out (by prompt: none of a held-out prompt's answers is trained on), drawn
    from ``rng`` (the trainer's, seeded by ``--seed``; it goes on to shuffle the training answers)."""
    prompts = list(range(count))
    rng.shuffle(prompts)
    return set(prompts[: max(1, int(count * fraction))])


def _reference_model(source: str):
    """The target's weights as stored: its fingerprint, and the embeddings, output rows and final norm a head
    starts from (no pass runs through it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True).eval()


def _vocabulary(examples: list[dict], size: int, vocab: int) -> torch.Tensor:
    """``TokenCounts.vocabulary`` over the examples' answers and prompts."""
    counts = TokenCounts()
    for e in examples:
        counts.add(e["tokens"], e["start"])
    return counts.vocabulary(size, vocab)


class TokenCounts:
    """How often each token occurs in answers and in their prompts: what a draft vocabulary is chosen from."""

    def __init__(self):
        self.answers: Counter = Counter()
        self.prompts: Counter = Counter()
        self.examples = 0

    def add(self, tokens: torch.Tensor, start: int) -> None:
        self.answers.update(tokens[start:].tolist())
        self.prompts.update(tokens[:start].tolist())
        self.examples += 1

    def vocabulary(self, size: int, vocab: int) -> torch.Tensor:
        """The ``size`` tokens the answers use most; ties and the rest filled by the prompts' tokens, then by id."""
        chosen = [t for t, _ in self.answers.most_common(size)]
        picked = set(chosen)
        for t, _ in self.prompts.most_common():
            if len(chosen) >= size:
                break
            if t not in picked:
                chosen.append(t)
                picked.add(t)
        t = 0
        while len(chosen) < size and t < vocab:
            if t not in picked:
                chosen.append(t)
            t += 1
        return torch.tensor(sorted(chosen[:size]))


# ---- the objective -------------------------------------------------------------------------------------------------


def _targets(head: EagleHead, example: dict, steps: int, first: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step j: the draft ids to predict for the rows of indices i >= ``first`` (``tokens[i + 2 + j]``) and which
    rows count (inside the answer, and in the draft vocabulary)."""
    tokens = example["tokens"].to(device)
    ids = head.draft_ids(tokens)
    out = []
    for j in range(steps):
        target = ids[first + 2 + j :]
        rows = torch.arange(target.shape[0], device=device) + first
        counted = (target >= 0) & (rows + 2 + j >= example["start"])
        out.append((target.clamp(min=0), counted))
    return out


def _first(example: dict) -> int:
    """The first index whose drafts land in the answer: the prompt's indices only give the keys drafts attend to."""
    return max(0, example["start"] - 2)


def window_loss(
    head: EagleHead,
    tokens,
    features,
    first: int,
    steps: int,
    labelled_from: int,
    context=None,
    keys_out=None,
    top: Top | None = None,
    labelled_until: int | None = None,
):
    """The summed cross-entropy of the chained draft steps for the indices from ``first`` over ``tokens`` [T]
    (a window's end: the rows past it are the next window's), step j weighted ``STEP_WEIGHT ** j``; and the
    positions step 0 counted. Index i's step j is labelled with the token the target chose (``tokens[i + 2 + j]``,
    counted where it is at or past ``labelled_from``, before ``labelled_until`` (padding: the sequence's end if not
    given) and in the draft vocabulary), or, at a position ``top`` holds,
    with the target's distribution there (its top tokens within the draft vocabulary, renormalised; not counted where
    they carry under ``SOFT_MASS`` of it: the target's likely tokens are not drafted at all). context, keys_out: as
    ``ttt_logits`` takes them."""
    logits = head.ttt_logits(tokens, features, steps, first=first, context=context, keys_out=keys_out)
    ids = head.draft_ids(tokens)
    soft = None
    if top is not None:  # the distributions' tokens as draft ids (-1 outside), their probabilities and mass
        top_ids = head.draft_ids(top.ids.to(ids.device).long())
        top_p = top.logp.to(ids.device).float().exp() * (top_ids >= 0)
        soft = (top_ids, top_p, top_p.sum(-1))
    total, counted = None, 0
    for j, step_logits in enumerate(logits):
        rows = step_logits.shape[0]
        target = ids[first + 2 + j : first + 2 + j + rows]
        where = torch.arange(first + 2 + j, first + 2 + j + rows, device=target.device)
        labelled = (where >= labelled_from) & (where < (labelled_until or len(tokens)))
        keep = (target >= 0) & labelled
        logq = torch.log_softmax(step_logits.float(), dim=-1)
        loss = -logq.gather(-1, target.clamp(min=0)[:, None])[:, 0]
        if soft is not None:
            at = where - 1 - top.first  # the position whose distribution labels the row
            has = (at >= 0) & (at < soft[0].shape[0])
            if has.any():
                at = at.clamp(0, soft[0].shape[0] - 1)
                p, mass = soft[1][at], soft[2][at]
                spread = -(p / mass.clamp(min=1e-9)[:, None] * logq.gather(-1, soft[0][at].clamp(min=0))).sum(-1)
                loss = torch.where(has, spread, loss)
                keep = torch.where(has, (mass > SOFT_MASS) & labelled, keep)
        if not keep.any():
            continue
        ce = loss[keep].sum() * STEP_WEIGHT**j
        total = ce if total is None else total + ce
        if j == 0:
            counted = int(keep.sum())
    return total, counted


def _loss(
    head: EagleHead,
    example: dict,
    steps: int,
    bucket: int = 0,
    labelled_from: int | None = None,
    noise: float = 0.0,
) -> tuple[torch.Tensor | None, int]:
    """``window_loss`` over one answer (its answer positions, labelled by the target's distribution kept there, and
    from ``labelled_from`` on where it is given, the prompt's tokens as they are); with a ``bucket``, over the answer
    padded to a multiple of it, from an index that is one: the padding is computed, never counted, and the chained
    steps of the prompt's last indices whose drafts land in the answer are trained; with ``noise``, over ``noisy``
    features."""
    device = head.d2t.device
    labelled_from = example["start"] if labelled_from is None else labelled_from
    first = max(0, labelled_from - 2)
    top = Top(example["top_ids"], example["top_logp"], example["start"] - 1)  # from the prompt's last position
    tokens = example["tokens"].to(device).long()
    features = example["features"].to(device).float()
    if noise:
        features = noisy(features, noise, len(head.config.aux_layers))
    length = tokens.shape[0]
    if bucket:
        first = first // bucket * bucket
        tokens = F.pad(tokens, (0, -length % bucket))
        features = F.pad(features, (0, 0, 0, tokens.shape[0] - 1 - features.shape[0]))
    return window_loss(head, tokens, features, first, steps, labelled_from, top=top, labelled_until=length)


@torch.inference_mode()
def evaluate(head: EagleHead, examples: list[dict], steps: int) -> dict:
    """Greedy drafts over held-out answers, as drafting would run them: per step the share of positions where
    that step and every one before it were right (a draft is accepted up to its first miss), and the mean accepted
    length (the verified token plus the drafts accepted)."""
    reached, positions = [0] * steps, 0
    for example in examples:
        got, rows = reach(head, example, steps)
        reached = [a + b for a, b in zip(reached, got)]
        positions += rows
    return acceptance(reached, positions)


def acceptance(reached: list[int], positions: int) -> dict:
    """``reached[j]``: positions whose drafts 0..j were all right, of ``positions``."""
    rates = [r / positions if positions else 0.0 for r in reached]
    return {"acceptance": [round(r, 4) for r in rates], "mean_accepted": round(1 + sum(rates), 3)}


@torch.inference_mode()
def reach(head: EagleHead, example: dict, steps: int) -> tuple[list[int], int]:
    """One answer's greedy drafts: per step, the positions where it and every step before it were right; and the
    positions drafted from."""
    was_training = head.training
    head.eval()
    device = head.d2t.device
    reached = [0] * steps
    first = _first(example)
    tokens = example["tokens"].to(device)
    logits = head.ttt_logits(tokens, example["features"].to(device).float(), steps, first=first)
    head.train(was_training)
    targets = _targets(head, example, len(logits), first, device)
    rows = targets[0][0].shape[0]
    if not logits or rows <= 0:
        return reached, 0
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    for j, (step_logits, (target, counted)) in enumerate(zip(logits, targets)):
        n = min(rows, step_logits.shape[0])
        alive = alive[:n] & (step_logits[:n].argmax(-1) == target[:n]) & counted[:n]
        reached[j] += int(alive.sum())
    return reached, rows


def _evaluate(head, heldout, steps, trained: float, loss) -> dict:
    return {
        "minutes": round(trained / 60, 2),
        "loss": None if loss is None else round(float(loss), 4),
        **evaluate(head, heldout, steps),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m depctl_runtime.training")
    parser.add_argument("target")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=None)
    for name, kind in (
        ("minutes", float),
        ("draft-vocab", int),
        ("steps", int),
        ("train-steps", int),
        ("max-tokens", int),
        ("samples", int),
        ("batch", int),
    ):
        parser.add_argument(f"--{name}", type=kind, default=getattr(TrainOptions, name.replace("-", "_")))
    parser.add_argument("--lr", type=float, default=TrainOptions.lr)
    parser.add_argument("--answer-share", type=float, default=TrainOptions.answer_share)
    parser.add_argument("--average", type=float, default=TrainOptions.average, help="running average decay a step")
    parser.add_argument(
        "--feature-noise", type=float, default=TrainOptions.feature_noise, help="noise on the features, relative"
    )
    parser.add_argument("--weight-decay", type=float, default=TrainOptions.weight_decay, help="AdamW's weight decay")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantization", default="none", choices=typing.get_args(Quantization))
    parser.add_argument("--compile", dest="compile", action="store_true", default=None)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument(
        "--no-written-requests", dest="written", action="store_false", help="answer the given prompts only"
    )
    parser.add_argument("--prompt-positions", action="store_true", help="train on the prompts' tokens too")
    parser.add_argument("--freeze-output", action="store_true", help="keep the target's output layer and final norm")
    args = parser.parse_args(argv)
    opts = TrainOptions(**vars(args))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the log is a file: the stages say how far it is

    def on_signal(*_):
        raise Stop()

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C anywhere is a Stop: saved state, no traceback
        signal.signal(sig, on_signal)
    try:
        train(opts)
    except (DataError, eagle_format.HeadError) as exc:
        emit("error", message=str(exc))
        return 2
    except Stop:  # before the first training step: answers already generated are kept in .train for the next run
        emit("stopped", trained=False)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
