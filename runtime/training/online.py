"""A draft head that learns from the deployment's own traffic while it serves (``--learn-draft-head``).

The deployment starts drafting with its n-gram or suffix index, or a head it is given to start from
(``--learn-draft-head-from``: one ``depctl draft train`` wrote, which drafts beside the index from the first request
and which training goes on from), or the head it learned before a restart. While it
answers, ``traffic.TrafficRecorder`` keeps what the target computed (the layer features an EAGLE-3 head reads, and
the tokens the target chose); when no deployment of the daemon has a request, the engine thread spends its idle
time here, a slice of about ``SLICE`` seconds at a time, so a request that arrives waits for one slice at most:

1. write the answers recorded while serving (``TrafficStore``);
2. train the head on them: EAGLE-3's training-time test (``EagleHead.ttt_logits``, as ``depctl draft train`` runs
   it) over windows of an answer sized to the slice, prompt positions included, the gradients of ``BATCH_ROWS``
   positions summed into one optimizer step; labels are the tokens the target chose, so nothing is computed for
   training while serving. The draft vocabulary is chosen again from every answer as they grow;
3. every so often compare the head in training with the serving one on the most recent held-out answers (the mean
   accepted length of greedy drafts at K); where it is better, it becomes the next generation: saved in the
   deployment's folder and swapped into the engine between steps (``SpeculativeEngine.swap_proposer``), no reload.

Traffic alone is too little to learn from: a head trained on a few hundred answers learns them, and drafts on new
prompts little better than at the start. So idle time also answers prompts of the deployment's own
(``answers.IdleAnswers``: the shipped set, then requests the target writes), recorded as traffic is: all the idle
time training cannot use, and ``ANSWER_SHARE`` of the rest, until the target has written ``answers.MAX_REQUESTS``
requests; on disk the newest of those answers replace the oldest beyond ``traffic.IDLE_SHARE`` of the budget.

Exactness never depends on the head: drafts only propose, and the target's verification decides every token. The
training's state (the head, the optimizer, the clocks and the comparisons) is saved at each comparison and when the
deployment stops, and a restart goes on from it.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from depctl_runtime.model import eagle_format
from depctl_runtime.model.eagle import EagleConfig, EagleHead
from depctl_runtime.model.runner import held_bytes
from depctl_runtime.speculation.policy import rate_for_mean_accepted
from depctl_runtime.training.answers import IdleAnswers
from depctl_runtime.training.eagle import (
    BATCH_ROWS,
    SHAPE_BUCKET,
    TRAIN_STEPS,
    TokenCounts,
    acceptance,
    adamw,
    average_pairs,
    average_step,
    averaged,
    reach,
    trainable,
    training_dtype,
    window_loss,
)
from depctl_runtime.training.state import load_state, save_state
from depctl_runtime.training.traffic import (
    Answer,
    TrafficRecorder,
    TrafficStore,
    private_dir,
    read_answer,
    read_tokens,
)

log = logging.getLogger("depctl.learning")

SLICE = 0.25  # seconds of training between looks at the inbox: what a request arriving in idle time may wait
MIN_ANSWERS = 16  # recorded answers before training starts
FIRST_COMPARISON = 30.0  # seconds of training before the first comparison: a first head serves early
COMPARE_EVERY = 120.0  # seconds of training between later comparisons
FIRST_HEAD_MIN = 1.3  # held-out mean accepted length at K for a first head to draft beside the n-gram or suffix index
BETTER_BY = 0.02  # ... and a later generation must beat the serving one by, on the same answers
EPOCHS = 8  # passes over the recorded positions before training waits for more traffic
LR = 5e-4
# training on from a trained head: at LR it drifts from where the head's annealing left it, and drafts worse for
# minutes (BENCHMARKS.md, "Training on from a given head, slower")
CONTINUED_LR = 2e-5
WARMUP_ROWS = 5_000  # positions over which the learning rate ramps up
# the weights' running average a candidate is measured and served as (Polyak averaging), per optimizer step: a
# constant learning rate never anneals, and the average of the last few hundred steps drafts as a head whose rate
# had decayed would, while training goes on (BENCHMARKS.md, "Averaged weights for a learning head")
AVERAGE = 0.998
# of the idle time training and answering both want, answering's: on a CPU a head learns more from more training
# than from more answers (BENCHMARKS.md, "An hour with idle answers through the compiled library")
ANSWER_SHARE = 1 / 3
# the draft vocabulary is chosen again from every training answer once they are this many times those it was chosen
# from: chosen when training starts, from a few dozen answers, most of it is filled by token id
VOCABULARY_GROWTH = 4
RECOUNT_FILES = 64  # answers whose tokens a unit of idle time counts for the next vocabulary
HISTORY_KEPT = 200


@dataclass
class LearnOptions:
    steps: int  # draft steps heads are measured at (the deployment's K)
    train_steps: int = TRAIN_STEPS
    slice_seconds: float = SLICE
    batch_rows: int = BATCH_ROWS
    min_answers: int = MIN_ANSWERS
    first_comparison: float = FIRST_COMPARISON
    compare_every: float = COMPARE_EVERY
    first_head_min: float = FIRST_HEAD_MIN
    epochs: float = EPOCHS
    lr: float = LR
    # training that goes on from a trained head (one a deployment started from, or a generation whose trainer state
    # is gone): its rate, and whether the running average's memory is full from the first step (a new head's first
    # weights are random, so its average starts short; a trained head's are already where training goes)
    continued_lr: float = CONTINUED_LR
    continued_full_memory: bool = True
    prompt_positions: bool = True  # train on the prompts' positions too (the prefill computed their features)
    # answers generated in idle time keep the target's distribution at each answer position, learned where kept
    soft_labels: bool = True
    average: float = AVERAGE  # the running average's decay per optimizer step (0: the candidate is the head itself)
    answer_share: float = ANSWER_SHARE  # of the idle time both could use, answering's (the rest is training's)
    train_dtype: str = "auto"  # a training step's products: bf16 where the hardware multiplies it, as draft train
    seed: int = 0


@dataclass(frozen=True)
class HeadStart:
    """A trained head a learning deployment starts from: where it was given, and how to read it (in float32, checked
    against the target; read only where the deployment has learned nothing yet)."""

    source: str
    read: Callable[[], tuple[EagleHead, dict]]  # the head, and its config.json


class HeadLearner:
    """A learning deployment's head: the traffic capture (the engine's observer), the training, the generations.

    Runs on the engine thread: ``has_work``/``work`` in idle time; ``status`` may be read from any thread."""

    def __init__(
        self,
        folder: Path,
        model: torch.nn.Module,
        config: EagleConfig,
        options: LearnOptions,
        disk_budget: int,
        make_proposer: Callable[[EagleHead], object],
        verifier: dict,
        start: HeadStart | None = None,
    ):
        self.folder = folder
        self.model = model
        self.config = config
        self.options = options
        self.make_proposer = make_proposer  # a float32 head -> the proposer that drafts with it
        self.verifier = verifier
        private_dir(folder)  # users' text and the states it produced: the owner's alone
        self.store = TrafficStore(folder / "traffic", disk_budget)
        self.recorder = TrafficRecorder(self.store)
        self.engine = None  # set by ``attach``
        self.device = model.get_input_embeddings().weight.device
        self.rng = random.Random(options.seed)
        self.generation = 0
        self.serving: EagleHead | None = None  # the serving generation in float32, for comparisons
        self.history: list[dict] = []
        self.trainer: _Trainer | None = None
        self.error: str | None = None
        self.rows_recorded = 0  # positions of the training answers ever recorded (the epochs' measure)
        self.answers: IdleAnswers | None = None  # the target's answers to prompts of its own, in idle time (``answer``)
        self._shipped_done = 0  # shipped prompts answered before a restart
        self._written = 0  # requests the target wrote before a restart
        # idle time since load spent answering while training could have run, and training: kept at answer_share
        self._answering_seconds = 0.0
        self._training_seconds = 0.0
        self._comparison: _Comparison | None = None
        self._recount: _Recount | None = None  # the next draft vocabulary's counting, under way
        self._since_comparison = 0.0
        self._live_from = (0, 0, 0)  # the engine's draft counters when the serving generation began
        self._served_score: float | None = None  # the serving generation's held-out score as saved with it
        self._vocabulary_answers = 0  # the answers the serving head's draft vocabulary was chosen from, where known
        self.started_from: str | None = None  # the head learning started from (``start``), where it did
        self._resume(start)

    # ---- load time ----
    def _resume(self, start: HeadStart | None) -> None:
        head_dir = self.folder / "head"
        if eagle_format.is_head(head_dir):
            try:
                verifier = (eagle_format.read_config(head_dir).get("speculators_config") or {}).get("verifier") or {}
                if verifier.get("fingerprint") != self.verifier["fingerprint"]:
                    raise eagle_format.HeadError("it was trained for other weights")
                head, config = eagle_format.load(head_dir, self._embeddings())
                self.serving = head.to(self.device)
                extra = config.get("depctl") or {}
                self.generation = int(extra.get("generation", 1))
                self._served_score = (eagle_format.measured(config) or (None,))[0]
                self._vocabulary_answers = int(extra.get("vocabulary_answers", 0))
                self.started_from = extra.get("started_from")
            except eagle_format.HeadError as exc:
                log.warning("the learned head in %s cannot be read (%s): learning starts over", head_dir, exc)
        if self.serving is None and start is not None:
            self._start_from(start.source, *start.read())
        saved = load_state(self._state_dir(), self.device) if self._state_dir().exists() else None
        fits = saved is not None and saved[2].get("config") == self.config.to_dict()
        if not (fits and saved[2].get("fingerprint") == self.verifier["fingerprint"]):
            self.rows_recorded = self.store.positions_on_disk()  # a new head trains on what is recorded already
            return
        head_state, optimizer_state, info = saved
        self.trainer = _Trainer(self._new_head(), self.options)
        self.trainer.restore(head_state, optimizer_state, info)
        self.history = info.get("history", [])
        self.rows_recorded = info.get("rows_recorded", 0)
        self._shipped_done = info.get("shipped_answered", 0)
        self._written = info.get("requests_written", 0)

    def _start_from(self, source: str, head: EagleHead, config: dict) -> None:
        """``head`` (given as ``source``, with its ``config``) serves as generation 1 from the first request, saved in
        the deployment's folder as a learned generation is; training goes on from its weights and draft vocabulary."""
        if head.config.to_dict() != self.config.to_dict():
            ours, theirs = self.config, head.config
            raise eagle_format.HeadError(
                f"it drafts within {theirs.draft_vocab_size} tokens from layers {list(theirs.aux_layers)}, and a "
                f"learning head within {ours.draft_vocab_size} from layers {list(ours.aux_layers)}: train it with "
                f"depctl draft train's defaults (--draft-vocab {ours.draft_vocab_size})"
            )
        head.embed_tokens.weight = torch.nn.Parameter(self._embeddings(), requires_grad=False)
        self.serving = head.to(self.device).eval().requires_grad_(False)
        self.generation = 1
        extra = config.get("depctl") or {}
        found = eagle_format.measured(config)
        if found is not None:  # the policy's first rate: the score at the draft steps learning measures at
            rate = rate_for_mean_accepted(*found)
            self._served_score = round((1 - rate ** (self.options.steps + 1)) / (1 - rate), 3)
        self._vocabulary_answers = int(extra.get("examples", 0))
        self.started_from = source
        kept = {
            "generation": 1,
            "started_from": self.started_from,
            "held_out_mean_accepted": self._served_score,
            "vocabulary_answers": self._vocabulary_answers,
        }
        eagle_format.save(head, self.folder / "head", self.verifier, self.options.steps, kept)
        _private_files(self.folder / "head")

    def initial_head(self) -> EagleHead | None:
        """The generation that served last, ready to serve again (a copy): None before any."""
        return copy.deepcopy(self.serving) if self.serving is not None else None

    def serving_mean_accepted(self) -> float | None:
        """The serving generation's mean accepted length at ``options.steps`` on the latest held-out answers it was
        measured on (for a head it started from and has not compared yet, the score it came with): what the engine's
        policy starts its drafts from after a restart."""
        measured = self._measured_here()
        return measured if measured is not None else self._served_score

    def _measured_here(self) -> float | None:
        """The serving generation's score in the latest comparison that measured it on this deployment's answers."""
        for h in reversed(self.history):
            if h["generation"] == self.generation and (h["promoted"] or h["serving"] is not None):
                return h["candidate"] if h["promoted"] else h["serving"]
        return None

    def answer(self, answers: IdleAnswers) -> None:
        """Spend idle time on ``answers`` too (from where a restart left off): all of what training cannot use, and
        ``options.answer_share`` of the rest while it writes requests."""
        answers.done = max(answers.done, min(self._shipped_done, len(answers.prompts)))
        answers.written = max(answers.written, self._written)
        self.answers = answers

    def attach(self, engine) -> None:
        self.engine = engine
        self._live_from = _draft_counters(engine)

    # ---- idle time ----
    def has_work(self) -> bool:
        if self.error is not None:
            return False
        if self.store.has_pending or self._comparison is not None or self._recount is not None:
            return True
        return self._training_due() or self._answering()

    def _training_due(self) -> bool:
        if len(self.store.training_files()) < self.options.min_answers or not self.store.held_out_files():
            return False
        trainer = self.trainer
        return trainer is None or trainer.rows < self.options.epochs * self.rows_recorded or self._owes_comparison()

    def _answering(self) -> bool:
        return self.answers is not None and self.answers.has_work()

    def work(self, seconds: float | None = None) -> None:
        """About ``seconds`` (one slice by default) of the next things to do: write, train, compare."""
        if self.error is not None:
            return
        seconds = self.options.slice_seconds if seconds is None else seconds
        until = time.perf_counter() + seconds
        try:
            while True:  # units while another as long as the last still fits in the slice
                t0 = time.perf_counter()
                if not self._unit():
                    return
                now = time.perf_counter()
                if now + (now - t0) > until:
                    return
        except Exception as exc:  # noqa: BLE001 - learning stops; serving goes on with the generation it has
            log.exception("the draft head's training failed; the deployment serves on without learning")
            self.error = f"{type(exc).__name__}: {exc}"

    def _unit(self) -> bool:
        """One bounded piece of work; False when there was none."""
        if self.store.has_pending:
            before = self.store.positions_written
            self.store.flush_one()
            self.rows_recorded += self.store.positions_written - before
            return True
        if self._comparison is not None:
            self._compare_one()
            return True
        if self._recount is not None:
            self._recount_some()
            return True
        due, answering = self._training_due(), self._answering()
        share = self.options.answer_share
        if answering and (not due or self._answering_seconds * (1 - share) <= self._training_seconds * share):
            t0 = time.perf_counter()
            for answer in self.answers.piece():  # a prompt chunk or one token of each answer
                self.store.put(answer)
            if due:  # the time training could have had
                self._answering_seconds += time.perf_counter() - t0
            return True
        if not due:
            return False
        if self.trainer is None and self.serving is not None:  # training goes on from the head that serves
            self.trainer = _Trainer(trainable_copy(self.serving), self.options, continued=True)
            self.trainer.vocabulary_answers = self._vocabulary_answers
        elif self.trainer is None:
            counts = _count(self.store.training_files())
            vocabulary = counts.vocabulary(self.config.draft_vocab_size, self.config.vocab_size)
            self.trainer = _Trainer(self._new_head(), self.options, vocabulary, self._final_norm())
            self.trainer.vocabulary_answers = counts.examples
        if self._owes_comparison():
            self._start_comparison()
            return True
        t0 = time.perf_counter()
        self.trainer.train_window(self._next_window, self.options.slice_seconds)
        self._since_comparison += time.perf_counter() - t0
        self._training_seconds += time.perf_counter() - t0
        return True

    def _owes_comparison(self) -> bool:
        trainer = self.trainer
        if trainer is None or trainer.steps == 0:
            return False
        # once training has caught up with the traffic, each new answer buys a moment of training: measured after as
        # much training as a first head waits for, not after every answer (a comparison reads every held-out answer)
        first = self.options.first_comparison
        due = first if not self.history else self.options.compare_every
        caught_up = trainer.rows >= self.options.epochs * self.rows_recorded
        return self._since_comparison >= due or (caught_up and self._since_comparison >= first)

    # ---- training data ----
    def _next_window(self) -> Answer:
        """The next answer to train on: a shuffled pass over the recorded answers, new ones joining the next pass."""
        trainer = self.trainer
        while True:
            if not trainer.queue:
                files = self.store.training_files()
                self.rng.shuffle(files)
                trainer.queue = files
            answer = read_answer(trainer.queue.pop())
            if answer is not None:
                return answer

    # ---- the draft vocabulary: the tokens the recorded answers use most, then their prompts' ----
    def _recount_due(self) -> bool:
        answers = len(self.store.training_files())
        return answers >= VOCABULARY_GROWTH * max(self.trainer.vocabulary_answers, 1)

    def _recount_some(self) -> None:
        r = self._recount
        _count(r.files[:RECOUNT_FILES], r.counts)
        del r.files[:RECOUNT_FILES]
        if r.files:
            return
        self._recount = None
        self.trainer.revocabulary(r.counts.vocabulary(self.config.draft_vocab_size, self.config.vocab_size))
        self.trainer.vocabulary_answers = r.counts.examples
        log.info("the learning head's draft vocabulary was chosen again, from %d answers", r.counts.examples)
        self.save()

    # ---- comparisons ----
    def _start_comparison(self) -> None:
        self.trainer.flush()
        self._since_comparison = 0.0
        files = self.store.held_out_files()
        self._comparison = _Comparison(files, self.options.steps, self.serving is not None)

    def _compare_one(self) -> None:
        c = self._comparison
        answer = read_answer(c.files.pop()) if c.files else None
        if answer is not None:
            example = answer.example()
            c.add("candidate", *reach(self.trainer.candidate, example, self.options.steps))
            if self.serving is not None:
                c.add("serving", *reach(self.serving, example, self.options.steps))
        if c.files:
            return
        self._comparison = None
        candidate = c.result("candidate")
        serving = c.result("serving") if self.serving is not None else None
        better = candidate >= self.options.first_head_min if serving is None else candidate >= serving + BETTER_BY
        if better:
            self._promote(candidate)
        self.history.append(
            {
                "at": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
                "trained_minutes": round(self.trainer.seconds / 60, 2),
                "answers": len(self.store.training_files()),
                "held_out": c.positions,
                "candidate": candidate,
                "serving": serving,
                "generation": self.generation,
                "promoted": better,
            }
        )
        del self.history[:-HISTORY_KEPT]
        self.save()
        if self._recount_due():  # chosen again between comparisons: the next one measures it after training
            self._recount = _Recount(self.store.training_files())

    def _promote(self, mean_accepted: float) -> None:
        """The head in training becomes the serving generation: saved, then swapped into the engine, which starts
        from the mean accepted length it reached on the held-out answers."""
        self.generation += 1
        head = copy.deepcopy(self.trainer.candidate).eval().requires_grad_(False)
        self.serving = head
        extra = {
            "generation": self.generation,
            "trained_minutes": round(self.trainer.seconds / 60, 2),
            "held_out_mean_accepted": mean_accepted,
        }
        eagle_format.save(head, self.folder / "head", self.verifier, self.options.steps, extra)
        _private_files(self.folder / "head")
        if self.engine is not None:
            proposer = self.make_proposer(copy.deepcopy(head))
            self.engine.swap_proposer(proposer, [], self.recorder.features, mean_accepted)
            self._live_from = _draft_counters(self.engine)
        log.info("the learned draft head's generation %d serves", self.generation)

    # ---- state ----
    def save(self) -> None:
        if self.trainer is None:
            return
        info = {
            **self.trainer.info(),
            "config": self.config.to_dict(),
            "fingerprint": self.verifier["fingerprint"],
            "history": self.history,
            "rows_recorded": self.rows_recorded,
            "shipped_answered": self.answers.done if self.answers is not None else self._shipped_done,
            "requests_written": self.answers.written if self.answers is not None else self._written,
        }
        folder = self._state_dir()
        private_dir(folder)
        save_state(folder, self.trainer.state(), self.trainer.optimizer.state_dict(), info)
        _private_files(folder)

    def release(self) -> None:
        """The deployment stops: write what waits, keep the training's state."""
        try:
            while self.store.flush_one() is not None:
                pass
            self.trainer is not None and self.trainer.flush()
            self.save()
        except Exception:  # noqa: BLE001 - a stop must not fail for this; the next load starts from what is on disk
            log.exception("saving the draft head's training failed")
        self.recorder.release()
        if self.answers is not None:
            self.answers.release()

    def memory_bytes(self) -> int:
        """What learning holds beyond the target: the head in training with its optimizer's moments, the serving
        generation, the features of the requests running, the answers waiting to be written and the idle
        answers' cache."""
        table = self.model.get_input_embeddings().weight  # the heads' frozen embeddings: the target's own, or a copy
        trainer = self.trainer
        parts = (trainer, trainer.optimizer.state) if trainer is not None else ()
        if self.answers is not None and self.answers.runner is not None:
            parts += (self.answers.runner.cache,)  # not the runner: it holds the target's weights
        return held_bytes(table, *parts, self.serving, self.recorder) - held_bytes(table) + self.store.pending_bytes

    def status(self) -> dict:
        trainer = self.trainer
        drafted, accepted, steps = (a - b for a, b in zip(_draft_counters(self.engine), self._live_from))
        out = {
            "generation": self.generation,
            "drafting": "head" if self.generation else "fallback",
            "started_from": self.started_from,
            "held_out_mean_accepted": self._measured_here(),
            "live": {
                "drafted": drafted,
                "accepted": accepted,
                "mean_accepted": round(1 + accepted / steps, 3) if steps else None,
            }
            if self.generation
            else None,
            "training": {
                "state": self._state(),
                "minutes": round(trainer.seconds / 60, 2) if trainer else 0.0,
                "optimizer_steps": trainer.steps if trainer else 0,
                "positions": trainer.rows if trainer else 0,
                "positions_recorded": self.rows_recorded,
                "vocabulary_answers": trainer.vocabulary_answers if trainer else 0,
                "shipped_prompts": {"answered": self.answers.done, "total": len(self.answers.prompts)}
                if self.answers is not None
                else None,
                "requests_written": self.answers.written if self.answers is not None else self._written,
            },
            "traffic": self.store.counts(),
            "history": self.history[-12:],
        }
        if self.error:
            out["error"] = self.error
        return out

    def _state(self) -> str:
        if self.error is not None:
            return "failed"
        training = self._comparison is not None or self._training_due()
        if self._answering():
            answers = self.answers
            what = (
                f"depctl's prompts ({answers.done} of {len(answers.prompts)})"
                if answers.remaining
                else f"requests the target writes ({answers.written} written)"
            )
            return f"training, and answering {what}" if training else f"answering {what} while traffic is short"
        if training:
            return "training"
        answers = len(self.store.training_files())
        if answers < self.options.min_answers or not self.store.held_out_files():
            held = "" if self.store.held_out_files() else ", none held out yet"
            return f"waiting for traffic ({answers} of {self.options.min_answers} answers{held})"
        return "caught up: waiting for more traffic"

    # ---- helpers ----
    def _state_dir(self) -> Path:
        return self.folder / "trainer"

    def _embeddings(self) -> torch.Tensor:
        """The target's input embeddings in float32 (its own table where it holds float32; frozen)."""
        table = self.model.get_input_embeddings().weight.detach()
        return table if table.dtype == torch.float32 else table.float()

    def _final_norm(self) -> torch.Tensor | None:
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        weight = getattr(norm, "weight", None)
        return weight.detach().float() if isinstance(weight, torch.Tensor) else None

    def _new_head(self) -> EagleHead:
        head = EagleHead(self.config)
        head.embed_tokens.weight = torch.nn.Parameter(self._embeddings(), requires_grad=False)
        head.inv_freq = head.inv_freq.to(self.device)
        return head.to(self.device)


class _Trainer:
    """The head in training, its optimizer, and the gradient summed over windows until ``batch_rows`` positions."""

    def __init__(
        self,
        head: EagleHead,
        options: LearnOptions,
        vocabulary: torch.Tensor | None = None,
        final_norm=None,
        continued: bool = False,
    ):
        self.head, self.options = head, options
        if vocabulary is not None:
            self._start(vocabulary, final_norm)
        self.continued = continued  # ``head`` was trained already: ``options.continued_*`` apply
        self.params = trainable(head)
        self.optimizer = adamw(self.params, self.lr)
        # the running average of the weights (the frozen embeddings shared, not copied): the candidate head
        self.average = averaged(head) if options.average else None
        self._average_pairs = average_pairs(self.average, head) if self.average is not None else []
        self.seconds = 0.0  # training time, comparisons excluded
        self.rows = 0  # positions trained on
        self.vocabulary_answers = 0  # the answers the draft vocabulary was chosen from
        self.steps = 0  # optimizer steps
        self.pending_rows = 0  # positions whose gradients are summed, not yet stepped
        self.queue: list[Path] = []  # this pass's answers still to train on
        self.window = 64  # positions a window: adapted so that one takes about a slice
        device, dtype = head.d2t.device, training_dtype(head.d2t.device, options.train_dtype)
        self.precision = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        # bf16 on a CPU: windows start at a multiple of this and span multiples of it, the answer's last one padded
        # (oneDNN builds bf16 products per shape, as ``draft train``'s answers are padded)
        self.bucket = SHAPE_BUCKET if dtype == torch.bfloat16 and device.type == "cpu" else 0
        self._answer: Answer | None = None
        self._at = 0  # the next window's first position in ``_answer``
        self._context = None  # step 0's keys and values of ``_answer``'s indices before ``_at`` (no gradient)

    def _start(self, vocabulary: torch.Tensor, final_norm: torch.Tensor | None) -> None:
        """A new head: the draft vocabulary, and the target's own output rows and final norm to start from."""
        head = self.head
        head.set_vocabulary(vocabulary.to(head.d2t.device))
        with torch.no_grad():
            head.lm_head.weight.copy_(head.embed_tokens.weight[head.target_ids])  # tied, or a fair start where not
            if final_norm is not None:
                head.norm.weight.copy_(final_norm)

    @property
    def lr(self) -> float:
        return self.options.continued_lr if self.continued else self.options.lr

    @property
    def candidate(self) -> EagleHead:
        """The head a comparison measures and a promotion serves: the running average, or the head itself."""
        return self.average if self.average is not None else self.head

    def state(self) -> dict:
        """The head's tensors and the average's (``average.`` before their names), the frozen embeddings left out."""
        state = {k: v for k, v in self.head.state_dict().items() if k != "embed_tokens.weight"}
        if self.average is not None:
            kept = self.average.state_dict().items()
            state.update({f"average.{k}": v for k, v in kept if k != "embed_tokens.weight"})
        return state

    def restore(self, state: dict, optimizer_state: dict, info: dict) -> None:
        """What ``state`` and the optimizer's state dict held; a state kept without an average starts one from the
        head's weights."""
        average = {k.removeprefix("average."): v for k, v in state.items() if k.startswith("average.")}
        self.head.load_state_dict({k: v for k, v in state.items() if not k.startswith("average.")}, strict=False)
        if self.average is not None:
            self.average.load_state_dict(average or self.head.state_dict(), strict=False)
        self.optimizer.load_state_dict(optimizer_state)
        self.seconds, self.rows, self.steps = info["seconds"], info["rows"], info["steps"]
        self.continued = info.get("continued", False)
        self.vocabulary_answers = info.get("vocabulary_answers", 0)  # (a state kept before: chosen again soon)

    def info(self) -> dict:
        return {
            "continued": self.continued,
            "seconds": self.seconds,
            "rows": self.rows,
            "steps": self.steps,
            "vocabulary_answers": self.vocabulary_answers,
        }

    def revocabulary(self, ids: torch.Tensor) -> None:
        """Draft within ``ids`` from now on. A token kept keeps its trained output row (in the running average and
        in AdamW's moments too); a new one starts from the target's row, as a new head's do, its second moment
        from the mean of the kept rows' (from zero, Adam would take its first steps on it several times too long)."""
        self.flush()
        head = self.head
        ids = ids.to(head.d2t.device)
        where = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        where[head.target_ids] = torch.arange(ids.numel(), device=ids.device)
        source = where[ids]  # each new draft id's old one, -1 where the token is new
        kept = source >= 0
        with torch.no_grad():
            moments = self.optimizer.state.get(head.lm_head.weight, {})
            if "exp_avg" in moments:
                m, v = moments["exp_avg"], moments["exp_avg_sq"]
                m.copy_(_moved(m, source, torch.zeros_like(m)))
                typical = v[kept].mean(0) if kept.any() else torch.zeros_like(v[0])
                v.copy_(_moved(v, source, typical.expand_as(v)))
            for model in (head, self.average) if self.average is not None else (head,):
                rows = model.lm_head.weight
                rows.copy_(_moved(rows, source, model.embed_tokens.weight[ids]))
                model.set_vocabulary(ids)

    def train_window(self, next_answer: Callable[[], Answer], seconds: float) -> None:
        """Forward and backward over one window of an answer; an optimizer step once ``batch_rows`` positions
        are summed. The window's width follows the time the last one took."""
        t0 = time.perf_counter()
        if self._answer is None or self._at >= len(self._answer.tokens) - 2:
            self._answer, self._context = next_answer(), None
            self._at = 0 if self.options.prompt_positions else max(0, self._answer.prompt_len - 2)
            self._at = self._at // self.bucket * self.bucket if self.bucket else self._at
        answer, start = self._answer, self._at
        end = min(len(answer.tokens), start + self.window + 2)
        self._at = end - 2
        self.head.train()
        device = self.head.d2t.device
        keys: list = []
        # the window's indices attend to every earlier one: their keys are the last window's, not computed again
        context = None if self._context is None else tuple(t[:, :start] for t in self._context)
        tokens, features = answer.tokens[:end].long().to(device), answer.features[: end - 1].to(device).float()
        if self.bucket:  # the answer's last window, padded: computed, never counted
            tokens = F.pad(tokens, (0, -(end - 2 - start) % self.bucket))
            features = F.pad(features, (0, 0, 0, tokens.shape[0] - 1 - features.shape[0]))
        with self.precision:
            loss, counted = window_loss(
                self.head,
                tokens,
                features,
                start,
                min(self.options.train_steps, self.options.steps),
                2 if self.options.prompt_positions else answer.prompt_len,
                context,
                keys,
                answer.top if self.options.soft_labels else None,
                labelled_until=end,
            )
        self._context = keys[0]
        if counted:
            (loss / self.options.batch_rows).backward()
            self.pending_rows += counted
            self.rows += counted
        if self.pending_rows >= self.options.batch_rows:
            self.flush()
        took = time.perf_counter() - t0
        self.seconds += took
        if took > 1.5 * seconds and self.window > max(16, self.bucket):
            self.window //= 2
        elif took < seconds / 2 and self.window < 512:
            self.window *= 2

    def flush(self) -> None:
        """An optimizer step over the summed gradients, if any."""
        if not self.pending_rows:
            return
        ramp = min(1.0, max(self.rows, 1) / WARMUP_ROWS)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * ramp
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_rows = 0
        self.steps += 1
        if self.average is not None:
            full = self.continued and self.options.continued_full_memory
            average_step(self._average_pairs, self.options.average, None if full else self.steps)


def trainable_copy(head: EagleHead) -> EagleHead:
    """A copy of a serving (frozen) ``head`` to train on from, sharing its frozen embeddings."""
    table = head.embed_tokens.weight
    copied = copy.deepcopy(head, {id(table): table}).requires_grad_(True).train()
    copied.embed_tokens.weight.requires_grad_(False)
    return copied


def _moved(rows: torch.Tensor, source: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Rows for a new vocabulary: row ``source[i]`` of ``rows`` where the token was kept (``source[i] >= 0``), the
    ``fresh`` one where it is new."""
    kept = source >= 0
    out = fresh.to(rows.dtype).clone()
    out[kept] = rows[source[kept]]
    return out


def _count(files: list[Path], counts: TokenCounts | None = None) -> TokenCounts:
    """The answers' tokens counted (into ``counts``), their features never read."""
    counts = TokenCounts() if counts is None else counts
    for read in filter(None, map(read_tokens, files)):
        counts.add(*read)
    return counts


class _Recount:
    """The tokens of every training answer, counted ``RECOUNT_FILES`` answers a unit, for the next vocabulary."""

    def __init__(self, files: list[Path]):
        self.files = list(files)
        self.counts = TokenCounts()


class _Comparison:
    """The candidate and the serving head on the same held-out answers, one answer a unit."""

    def __init__(self, files: list[Path], steps: int, with_serving: bool):
        self.files = list(files)
        self.reached = {"candidate": [0] * steps, "serving": [0] * steps}
        self.counted = {"candidate": 0, "serving": 0}
        self.positions = 0

    def add(self, which: str, reached: list[int], positions: int) -> None:
        self.reached[which] = [a + b for a, b in zip(self.reached[which], reached)]
        self.counted[which] += positions
        if which == "candidate":
            self.positions += positions

    def result(self, which: str) -> float:
        return acceptance(self.reached[which], self.counted[which])["mean_accepted"]


def _private_files(folder: Path) -> None:
    folder.chmod(0o700)
    for path in folder.iterdir():
        path.chmod(0o600)


def _draft_counters(engine) -> tuple[int, int, int]:
    """The head's (draft tokens, accepted, steps that drafted) so far, apart from the n-gram or suffix index's copies:
    the serving generation's live acceptance is the change."""
    if engine is None:
        return (0, 0, 0)
    s = engine.stats
    return (s.num_model_draft_tokens, s.num_model_accepted_tokens, s.num_model_drafts)
