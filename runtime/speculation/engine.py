"""SpeculativeEngine: one batch step, propose -> verify -> accept -> advance, over every running sequence at once.

It takes token ids and returns token ids; it knows nothing of tokenizers, text or HTTP, and nothing of who waits:
the ``Scheduler`` decides which sequences run (rows ``0..B-1`` of every cache) and when prompts are prefilled. A row
without drafts runs a plain decode step inside the same pass, so "speculation off" is measured with the same code.

A fault in one row's own part of a step (its grammar, its proposer's guess, its sampling) ends that row alone with a
``RowFault`` (finish_reason "error"); the other rows' step goes on untouched. Only a fault in the batch's shared work
(the target's pass, a draft model's forward) fails the step, and the worker ends the step's requests.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple
from typing import Sequence as Seq

import torch

from depctl_runtime.model.prefix import PrefixStore, tail_key
from depctl_runtime.model.runner import ModelRunner, PromptPass, greedy
from depctl_runtime.speculation.faults import record_fault
from depctl_runtime.speculation.grammar import RowGrammar
from depctl_runtime.speculation.params import GenerationParams
from depctl_runtime.speculation.policy import (
    FREE,
    MAX_TREE_TOKENS,
    MODEL,
    CostModel,
    DraftLengthPolicy,
    RequestAcceptance,
    RowPlan,
)
from depctl_runtime.speculation.proposers import FeatureObserver, ModelProposer, PredictionTracker, Proposer
from depctl_runtime.speculation.sampling import apply_penalties, probs_from_logits, token_logprobs
from depctl_runtime.speculation.sequence import Sequence, StepOutput
from depctl_runtime.speculation.stats import SpecDecodeStats
from depctl_runtime.speculation.verify import (
    DraftTree,
    verify_greedy,
    verify_sampled,
    verify_seeded,
    verify_tree_greedy,
    verify_tree_sampled,
    verify_tree_seeded,
)


@dataclass
class EngineConfig:
    num_draft_tokens: int = 0  # K, the most tokens drafted per row per step
    max_context: int = 2048  # prompt + output may not exceed this
    eos_token_ids: tuple[int, ...] = ()
    adaptive: bool = True  # let DraftLengthPolicy pick the draft width each step
    prediction_draft_tokens: int = 8  # K for a request's predicted output (drafting from it is free)
    grammar_draft_tokens: int = 8  # most tokens a grammar's forced continuation drafts in one step
    prefix_cache_bytes: int = 0  # the prefix cache's budget (model.prefix); 0: none
    prefix_block: int = 128  # tokens a cached block: the scheduler's prefill chunk, so that blocks are whole chunks
    # draft trees from a draft model: 0 lets the policy choose chain or tree, 1 drafts chains only, b >= 2 drafts a
    # tree of b branches whenever every row can take one (benchmarks, tests)
    tree_branches: int = 0
    # a draft model's (or head's) drafts are verified only while its own probability of the chain so far pays for
    # verifying them (``DraftLengthPolicy.draft_threshold``); off, a row verifies the width the policy chose
    cut_unsure_drafts: bool = False


class DraftSource(enum.Enum):
    """Where a row's drafts come from this step."""

    PREDICTION = "prediction"  # the request's predicted output
    FREE = "free"  # the deployment's free proposer (n-gram, suffix)
    MODEL = "model"  # the draft model, run after the width is chosen
    GRAMMAR = "grammar"  # the tokens the request's grammar forces next


@dataclass
class Guess:
    """A row's drafts for this step before the width is known: a free guess, or room for a draft model's."""

    tokens: list[int]
    acceptance: RequestAcceptance
    source: DraftSource | None  # None: no speculation for this row
    available: int = 0
    prediction_start: int | None = None  # where in the prediction this step's guess starts (-1: none; None: not asked)


class StepDrafts(NamedTuple):
    """A step's drafts (``SpeculativeEngine._drafts``)."""

    drafts: list  # per row, its drafts (a ``DraftTree`` where the step drafts trees)
    probs: list  # per row, their draft probabilities (None: one-hot)
    model_tokens: list  # per row, the draft model's own tokens where it ran (its cache keeps what the target took)
    caught_up: int  # the most tokens a row fed the draft model before it drafted
    first_choices: list | None  # per model row, the draft's best tokens at the first position
    chains: list | None = None  # per row, the draft's probability of its chain up to each draft (with ``sure``)
    forwards: int = 0  # draft forwards after the first position
    forward_seconds: float = 0.0  # and their cost


@dataclass
class _Reading:
    """A prompt chunk being read a part of a layer at a time."""

    seq: Sequence
    chunk: PromptPass
    start: int  # the chunk's first position


class SpeculativeEngine:
    def __init__(
        self,
        target: ModelRunner,
        proposer: Proposer | None = None,
        config: EngineConfig | None = None,
        prediction_tracker: Callable[[Seq[int]], PredictionTracker] = PredictionTracker,
        observer: FeatureObserver | None = None,
    ):
        self.target = target
        self.prediction_tracker = prediction_tracker  # how a request follows its predicted output
        self.proposer = proposer
        self.config = config or EngineConfig()
        self.stats = SpecDecodeStats()  # the deployment's totals
        # the proposer that runs a model with the target's rows (None for free proposers)
        self.draft_model: ModelProposer | None = proposer if hasattr(proposer, "accepted") else None
        # sees what the target computed for every sequence, drafting or not (a learning head's traffic capture)
        self.observer = observer
        # beside a model proposer, a free one whose guess, where it has one, is drafted instead (a learning head's
        # n-gram or suffix index: a copy it finds is accepted whole more often than a head's guess)
        self.free: Proposer | None = None
        self.policy = DraftLengthPolicy(
            max_k=self.config.num_draft_tokens if proposer else 0,
            adaptive=self.config.adaptive,
            tree_branches=self.config.tree_branches,
        )
        # prompt blocks already read, for requests that start the same way; not where a proposer or the observer must
        # see every prompt position's layer features (an EAGLE head), which the blocks do not keep
        self.prefix: PrefixStore | None = None
        if self.config.prefix_cache_bytes > 0 and not any(
            getattr(part, "needs_prompt_features", False) for part in (proposer, observer)
        ):
            self.prefix = PrefixStore(self.config.prefix_cache_bytes, self.config.prefix_block)
        # whether the target's prompt passes give the same bits wherever a prompt is cut within a block: then a
        # prompt may resume mid-block (from a tail, or part of a block) and be read in narrower chunks beside running
        # streams; elsewhere prompts are read in whole blocks and the cache keeps and uses whole blocks only
        self.cuts_exact = self.target.prompt_cuts_exact()
        # the prompt chunk whose pass is half-way through its layers (``prefill`` with ``more``), if any
        self._reading: _Reading | None = None
        self._answer: Sequence | None = None  # the finished sequence whose blocks row 0 holds (``keep_answer``)
        # computes grammar masks during the target pass (llguidance releases the GIL); it uses a row's matcher only
        # while the engine thread waits on that pass, so the two never touch one matcher at once
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="depctl-grammar")

    @property
    def _feature_sinks(self) -> list:
        """Whatever takes the target's layer features of each position read: the draft model (or head), the observer."""
        return [part for part in (self.draft_model, self.observer) if part is not None]

    @property
    def prefix_mid_block(self) -> bool:
        """Whether the prefix cache keeps tails and prompts resume from the middle of a block."""
        return self.prefix is not None and self.cuts_exact

    @property
    def max_rows(self) -> int:
        return self.target.max_rows

    def set_num_draft_tokens(self, k: int) -> None:
        """Change K in place (``depctl deployment update --draft-token-count``): no model is reloaded."""
        self.config.num_draft_tokens = k
        self.policy.max_k = k if self.proposer else 0
        self.target.set_max_width(1 + self.policy.max_k)

    @torch.inference_mode()
    def swap_proposer(
        self, proposer: ModelProposer, rows: Seq[Sequence], features, mean_accepted: float | None = None
    ) -> None:
        """Draft with ``proposer`` from the next step on (a new generation of a learning head), rows under way
        included: each sequence holding a row (a prompt half read too) is handed the target's layer features of the
        positions read so far (``features(seq)`` [n, F], None before any), as if the proposer had followed it from
        its first token. Its draft cost is measured first, and its mean accepted length at K, where measured, is the
        next requests' prior for its drafts. Drafts only propose, so the output is the target's whichever proposer
        drafted any step."""
        old = self.draft_model
        if old is None and self.proposer is not None:
            self.free = self.proposer  # the n-gram or suffix index goes on drafting where it finds a match
        prompt = [(i * 7919) % min(self.target.vocab_size or 256, 1000) for i in range(64)]
        proposer.calibrate(self.policy.draft_cost, self.target.max_rows, prompt)
        for seq in rows:
            read = features(seq)
            if read is not None:
                proposer.prefilled(seq, 0, read)
        self.proposer = self.draft_model = proposer
        self.policy.max_k = self.config.num_draft_tokens
        self.policy.new_draft_model(mean_accepted)
        if old is not None:
            old.release()

    # ---- a sequence's life: new -> prefill (in chunks) -> step ... -> finish ----
    def new_sequence(self, prompt_ids: Seq[int], params: GenerationParams) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_ids) >= self.config.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_context}")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.config.eos_token_ids))
        limit = min(params.max_tokens, self.config.max_context - len(prompt_ids))
        prediction = self.prediction_tracker(params.prediction) if params.prediction else None
        prediction_prior = self.policy.new_request(prior=0.8) if params.prediction else None
        # a forced token is rejected only where the grammar allows other spellings of the same text
        grammar_prior = self.policy.new_request(prior=0.95) if params.grammar is not None else None
        return Sequence(
            list(prompt_ids),
            params,
            limit,
            frozenset(stop_ids),
            self.policy.new_request(),
            prediction,
            prediction_prior,
            self.target.device,
            grammar_prior,
            self.policy.new_request(model=True),
        )

    @torch.inference_mode()
    def prefill(self, seq: Sequence, budget: int, more: Callable[[], bool] | None = None) -> StepOutput | None:
        """Feed up to ``budget`` more prompt tokens into ``seq``'s row; the last chunk yields its first token.

        more: None reads the chunk whole; otherwise its pass stops between parts of layers (attention, MLP) once
        ``more()`` is false, and the next call goes on with it (the same chunk, the same bits). Returns None until the
        prompt is read."""
        t0 = time.perf_counter()
        # chunks within blocks: whole blocks, or narrower where cuts leave the same bits (``cuts_exact``); a prompt
        # cut otherwise (a scheduler with another chunk) neither reads nor keeps cached blocks
        block = self.config.prefix_block
        in_blocks = budget == block or (self.cuts_exact and budget < block)
        cached = self.prefix is not None and in_blocks
        if self._answer is not None and seq.row == 0:  # idle work (``keep_answer``) held row 0: requests come first
            self.release_row(0)
        reading = self._reading
        if reading is not None and reading.seq is not seq:
            raise RuntimeError(f"row {reading.chunk.row} is half-way through a prompt chunk of another sequence")
        if reading is None:
            if cached and seq.prefilled == 0:
                self._restore_prefix(seq)
            end = seq.prompt_len
            if in_blocks:  # chunks end on block boundaries (a prompt resumed mid-block reads up to the next first)
                end = min(end, (seq.prefilled // block + 1) * block)
            chunk = seq.tokens[seq.prefilled : end][:budget]
            reading = self._reading = _Reading(seq, self.target.begin_prefill(seq.row, chunk), seq.prefilled)
        done = reading.chunk.run(more)
        if done:
            self._reading = None
            logits, features = reading.chunk.result()  # [1, vocab], [len(chunk), F] or None
            for sink in self._feature_sinks:
                sink.prefilled(seq, seq.prefilled, features, lambda: logits)
            seq.prefilled += reading.chunk.width
            if cached:
                self._keep(seq, seq.prefilled, seq.prompt_len)
        self.stats.prefill_seconds += time.perf_counter() - t0
        if not done:
            return None
        if seq.prefilled < seq.prompt_len:
            return None
        # the first output token, chosen as a step with no drafts would choose it
        rows = slice(0, 1)
        try:
            _, token = self._accept(seq, [], None, lambda rows: logits[rows], rows, greedy(logits).tolist())
            seq.tokens.append(token)
            pa = seq.prediction.observe_first(token) if seq.prediction is not None else 0
            logprobs = self._logprobs(seq, [token], lambda: logits[rows])
            return self._emit(seq, [token], pa=pa, logprobs=logprobs, cached=seq.cached_tokens)
        except Exception as exc:  # noqa: BLE001 - this row's grammar, sampling or prediction: it ends alone
            return self._failed(seq, "sampling", exc)

    @torch.inference_mode()
    def keep_answer(self, seq: Sequence, more: Callable[[], bool] | None = None) -> bool:
        """Idle time: put into the prefix store what the store lacks of a finished sequence's tokens, its prompt and
        its answer (whole blocks, and the tail after them where prompts may resume mid-block), so that a prompt going
        on from the answer (a conversation's next turn) starts from them. The answer's own keys and values came from
        decode passes, which round differently from a prompt's chunks, so they are read again here as a later prompt
        would read them: row 0 (free while idle), one chunk's pass a call, stopping between parts of layers once
        ``more()`` is false. True once nothing is left to read; the next request's ``prefill`` takes row 0 back,
        dropping a chunk half read."""
        block = self.prefix.block
        reading = self._reading
        if reading is not None and reading.seq is not seq:
            raise RuntimeError(f"row {reading.chunk.row} is half-way through a prompt chunk of another sequence")
        if reading is None:
            end = min(seq.answered, self.config.max_context)
            if not self.prefix_mid_block:
                end -= end % block
            if self._answer is not seq:  # row 0 starts from what the store holds of this sequence
                self.target.set_length(0, 0)
                self._answer = seq
            # the row only grows, so blocks evicted behind it (a budget smaller than the sequence) are never read again
            start = self._write_found(seq, 0, self.target.length(0), end)
            if start == end:
                return True
            chunk = self.target.begin_prefill(0, seq.tokens[start : min(end, (start // block + 1) * block)])
            reading = self._reading = _Reading(seq, chunk, start)
        if not reading.chunk.run(more):
            return False
        self._reading = None
        self.prefix.from_answers += self._keep(seq, reading.start + reading.chunk.width, end=None, row=0)
        return False

    def _restore_prefix(self, seq: Sequence) -> None:
        """Start ``seq``'s row from the stored blocks of its prompt's longest stored prefix, leaving at least its last
        token to read (its logits give the first output token)."""
        self.prefix.queries += seq.prompt_len
        if not self.target.cache.allocated:
            return
        seq.prefilled = seq.cached_tokens = self._write_found(seq, seq.row, 0, seq.prompt_len - 1)
        self.prefix.hits += seq.cached_tokens

    def _write_found(self, seq: Sequence, row: int, start: int, end: int) -> int:
        """Write into ``row`` (holding ``start`` positions of ``seq``, ``start`` on a block boundary or at a tail's
        end) what the store holds of ``seq``'s tokens from ``start`` up to at most ``end``; returns where the row
        ends then."""
        store, block = self.prefix, self.prefix.block
        if start % block:  # a tail was read last: nothing stored goes on from the middle of a block
            return start
        keys = seq.prefix_keys(end // block, block)
        limit = end if self.prefix_mid_block else 0
        found = store.lookup(keys[start // block :], self._parent(seq, start), seq.tokens, limit)
        for stored in found.blocks:
            self.target.write_block(row, start, stored.tensors)
            start += block
        if found.part is not None:
            self.target.write_block(row, start, [(k[:, : found.n], v[:, : found.n]) for k, v in found.part.tensors])
            start += found.n
        return start

    def _parent(self, seq: Sequence, start: int) -> bytes:
        """The key of the block ending at ``start`` (a block boundary), or the prefix's root at 0."""
        return seq.prefix_keys(start // self.prefix.block, self.prefix.block)[-1] if start else seq.root_key()

    def _keep(self, seq: Sequence, upto: int, end: int | None, row: int | None = None) -> bool:
        """A chunk's pass has written ``seq``'s row up to ``upto``: keep the block it completed, or, where it ended a
        prompt (``upto == end``; None: any chunk) short of a block's end, that tail. row: where it was read, if not
        ``seq``'s. Whether something was added."""
        block = self.prefix.block
        first = (upto - 1) // block * block  # the block the chunk ended in
        if upto % block and not (self.prefix_mid_block and (end is None or upto == end)):
            return False
        parents = seq.prefix_keys(first // block, block)
        tokens = tuple(seq.tokens[first:upto])
        key = (
            seq.prefix_keys(first // block + 1, block)[-1]
            if upto % block == 0
            else tail_key(self._parent(seq, first), tokens)
        )
        if key in self.prefix:
            return False
        tensors = self.target.read_block(seq.row if row is None else row, first, upto - first)
        return self.prefix.add(key, tensors, tokens, parents, seq.root_key())

    @torch.inference_mode()
    def step(self, batch: list[Sequence]) -> list[StepOutput]:
        """One speculative step for rows 0..B-1 (``batch[b].row == b``), each emitting at least one token."""
        t0 = time.perf_counter()
        # propose: free guesses first, then one draft width for the batch (policy), then the draft model
        guesses = self._guesses(batch)
        plans = [self._plan(seq, g) for seq, g in zip(batch, guesses)]
        width, predicted = self.policy.width(plans, trees=self._trees_possible(batch, guesses))
        if width and not self.policy.model_drafts:  # the rows with free guesses draft alone: no draft forward
            guesses = [replace(g, available=0) if g.source == DraftSource.MODEL else g for g in guesses]
        if width and self.policy.row_drafts is not None:  # each row verifies as many guesses as pay for their place
            guesses = [replace(g, available=min(g.available, d)) for g, d in zip(guesses, self.policy.row_drafts)]
        branches = self.policy.branches if width else 1
        sure = self._draft_threshold(len(batch)) if width and branches == 1 else 0.0  # (a tree drafts whole)
        drafted = self._drafts(batch, guesses, width, branches, sure)
        drafts, draft_probs, model_drafts = drafted.drafts, drafted.probs, drafted.model_tokens
        first_choices, chains = drafted.first_choices, drafted.chains
        drafted_model = model_drafts[0] is not None and width > 0  # the draft model ran: its passes are this step's
        if sure > 0:
            # rows whose drafts lost confidence (or were never drafted) verify fewer: expect what they verify
            predicted = self.policy.expected(
                [RowPlan(g.acceptance, len(d), g.source == DraftSource.MODEL) for g, d in zip(guesses, drafts)], width
            )
        t1 = time.perf_counter()
        # the grammar masks every verified position of a sampling row needs, computed while the pass runs
        masks = {
            b: self._grammar_thread.submit(seq.grammar.masks, drafts[b])
            for b, seq in enumerate(batch)
            if seq.grammar is not None
            and seq.fault is None
            and (not seq.sampling.greedy or seq.params.penalties.active)
        }
        # verify: ONE target pass over [last token, its drafts] for every row (a ragged, unpadded stream); a tree's
        # tokens each see their own branch
        trees = [_ancestry(d) for d in drafts] if branches > 1 else None
        scores = self.target.score(0, [[seq.tokens[-1]] + list(d) for seq, d in zip(batch, drafts)], trees=trees)
        argmax = scores.argmax()  # [T]: the step's one host sync for greedy rows
        t2 = time.perf_counter()
        outputs, at = [], 0
        feeds = bool(self._feature_sinks)  # once a step: the pass's features go to a draft model or the observer
        for b, seq in enumerate(batch):
            rows = slice(at, at + len(drafts[b]) + 1)  # this row's k_b + 1 positions of the stream
            at = rows.stop
            if seq.fault is not None:
                outputs.append(self._failed(seq))
                continue
            if isinstance(drafts[b], DraftTree):
                outputs.append(self._tree_row(seq, guesses[b], drafts[b], scores, rows, argmax, first_choices[b]))
                continue
            part = "sampling"
            try:
                # accept: the longest prefix of the drafts the target agrees with, plus the target's own next token
                allowed = masks[b].result() if b in masks else None
                n, token = self._accept(seq, drafts[b], draft_probs[b], scores.logits, rows, argmax, allowed)
                # advance: extend the sequence; every cache row goes back to the accepted length (bookkeeping only)
                logprobs = self._logprobs(
                    seq, drafts[b][:n] + [token], lambda: scores.logits(slice(rows.start, rows.stop))
                )
                read = (None, None)
                if feeds:  # what the pass computed at the positions of the tokens it accepted
                    kept = slice(rows.start, rows.start + n + 1)
                    features = None if scores.features is None else scores.features[kept]
                    read = (features, lambda kept=kept: scores.logits(kept))
                part = "proposer"
                if first_choices is not None and first_choices[b] is not None and drafts[b]:
                    self.policy.observe_first_choices(first_choices[b], drafts[b][0] if n else token)
                if chains is not None and guesses[b].source == DraftSource.MODEL and drafts[b]:
                    self.policy.observe_confidence(chains[b][: len(drafts[b])], n)
                outputs.append(self._advance(seq, guesses[b], drafts[b], n, token, model_drafts[b], logprobs, read))
            except Exception as exc:  # noqa: BLE001 - this row's grammar, sampling or proposer: it ends alone
                outputs.append(self._failed(seq, part, exc))
        (self.policy.tree_cost if trees else self.policy.verify_cost).observe(len(argmax), t2 - t1)
        realised: dict[str, int] = {}  # per kind of row that drafted, the tokens it emitted beyond one
        for guess, d, out in zip(guesses, drafts, outputs):
            if d:
                kind = MODEL if guess.source == DraftSource.MODEL else FREE
                realised[kind] = realised.get(kind, 0) + len(out.token_ids) - 1
        if realised:
            self.policy.observe_step(predicted, realised, len(batch))
        # what drafting costs, from chain steps that fed the draft its usual one or two tokens: after plain steps it
        # first catches up on every token it missed, a prefill that says nothing of what drafting costs. The first
        # position (catch-up, first forward, the step's planning) and each forward after it are priced apart
        if drafted_model and branches == 1 and drafted.caught_up <= self.draft_model.steady_catch_up:
            if drafted.forwards:
                self.policy.draft_cost.observe(len(batch), drafted.forward_seconds / drafted.forwards)
            self.policy.draft_start_cost.observe(len(batch), (t1 - t0) - drafted.forward_seconds)
        elif drafted_model and branches == 1:  # the draft read what it missed first: a catch-up, priced by its tokens
            fed = sum(p.behind for p, g in zip(plans, guesses) if g.source == DraftSource.MODEL and g.available)
            self.policy.catch_up_cost.observe(max(fed, 1), (t1 - t0) - drafted.forward_seconds)
        t3 = time.perf_counter()
        # the guard judges each kind apart; a step whose draft model ran is its kind's even where no row kept a draft
        kind = MODEL if MODEL in realised or drafted_model else FREE if realised else None
        self.policy.observe_step_time(t3 - t0, len(batch), sum(len(o.token_ids) for o in outputs), kind)
        self.stats.record_step(t1 - t0, t3 - t1)
        return outputs

    def move_row(self, src: int, dst: int) -> None:
        pending = 0
        if self._reading is not None and self._reading.chunk.row == src:
            pending = self._reading.chunk.width
            self._reading.chunk.move(dst)
        self.target.move_row(src, dst, pending)
        if self.draft_model is not None:
            self.draft_model.move_row(src, dst)

    def release_row(self, row: int) -> None:
        if self._reading is not None and self._reading.chunk.row == row:
            self._reading = None
        if row == 0:
            self._answer = None
        self.target.set_length(row, 0)
        if self.draft_model is not None:
            self.draft_model.set_length(row, 0)

    def finish(self, seq: Sequence) -> None:
        free = self.proposer if self.draft_model is None else self.free
        if free is not None and seq.fault is None:
            free.finish(seq)  # suffix speculation keeps the finished request as context for later ones
        if self.observer is not None:
            self.observer.finished(seq)
        self.policy.end_request(seq.acceptance, seq.model_acceptance if self.free is not None else None)
        self.stats.num_requests += 1

    # ---- the parts of a step ----
    def _failed(self, seq: Sequence, part: str | None = None, exc: BaseException | None = None) -> StepOutput:
        """The row's last output: it ends with its fault (recorded now from ``exc``, raised by its ``part``)."""
        if exc is not None:
            record_fault(seq, part, exc)
        seq.finish_reason = "error"
        self.stats.num_row_faults += 1
        return StepOutput([], "error", error=seq.fault)

    def _guesses(self, batch: list[Sequence]) -> list[Guess]:
        """Each row's guess (a row whose guess failed is faulted, with no drafts); none at all in a batch whose band
        has free guesses turned off until its next probe, or whose step is the guard's own plain one
        (``RegimeGuard.proposes``): the lookups would be refused.
        Not for a lone row, whose copies the policy probes itself, nor beside a draft model or a predicted output,
        which follow their rows step by step."""
        if (
            len(batch) > 1
            and self.draft_model is None
            and all(seq.prediction is None for seq in batch)
            and not self.policy.guard.proposes(len(batch), FREE)
        ):
            return [Guess([], seq.acceptance, None) for seq in batch]
        return [self._guess(seq) for seq in batch]

    def _guess(self, seq: Sequence) -> Guess:
        part = "proposer"
        try:
            guess = self._proposed(seq)
            part = "grammar"
            return guess if seq.grammar is None else self._constrain(seq, seq.grammar, guess)
        except Exception as exc:  # noqa: BLE001 - recorded on the row, which ends after the pass without drafts
            record_fault(seq, part, exc)
            return Guess([], seq.acceptance, None)

    def _constrain(self, seq: Sequence, grammar: RowGrammar, guess: Guess) -> Guess:
        """A guess within the row's grammar: cut at the first token it forbids, and led by the tokens it forces
        (free, and nearly always accepted). A draft model's drafts are masked as they are drafted instead."""
        if guess.source is DraftSource.MODEL:
            return guess
        tokens = guess.tokens[: grammar.valid_prefix(guess.tokens)]
        limit = seq.room if seq.params.max_draft_tokens is None else min(seq.room, seq.params.max_draft_tokens)
        forced = grammar.forced(min(limit, self.config.grammar_draft_tokens)) if seq.params.speculate else []
        # forced text is tokenized as the tokenizer would; where the grammar wants other tokens (bytes spelled out
        # where the tokenizer has a special token), only the part it allows is drafted
        forced = forced[: grammar.valid_prefix(forced)]
        if len(forced) > len(tokens) or tokens[: len(forced)] != forced:
            start = guess.prediction_start if guess.source is not DraftSource.PREDICTION else -1
            return Guess(forced, seq.grammar_acceptance, DraftSource.GRAMMAR, len(forced), start)
        return replace(guess, tokens=tokens, available=len(tokens))

    def _proposed(self, seq: Sequence) -> Guess:
        params = seq.params
        if not params.speculate:
            return Guess([], seq.acceptance, None)
        room = seq.room if params.max_draft_tokens is None else min(seq.room, params.max_draft_tokens)
        rejoin_guess: list[int] = []
        start = None
        if seq.prediction is not None:
            start, tokens = seq.prediction.propose(
                seq.tokens[seq.prompt_len :], min(room, self.config.prediction_draft_tokens)
            )
            if tokens and (seq.prediction.following or self.proposer is None):
                return Guess(tokens, seq.prediction_acceptance, DraftSource.PREDICTION, len(tokens), start)
            # off the prediction: a guess at where the output rejoins it comes after the deployment's own proposer,
            # whose match is measured against the text just written
            rejoin_guess = tokens
        if self.proposer is None:
            return Guess([], seq.acceptance, None, prediction_start=start)
        if rejoin_guess:  # unless drafted below, this step's output is not checked against the rejoin guess
            start, rejoin_start = -1, start
        k = min(room, self.policy.max_k)
        if self.draft_model is not None:
            tokens = self.free.propose(seq, k) if self.free is not None and k > 0 else []
            if tokens:
                return Guess(tokens, seq.acceptance, DraftSource.FREE, len(tokens), start)
            acceptance = seq.model_acceptance if self.free is not None else seq.acceptance
            return Guess([], acceptance, DraftSource.MODEL, max(k, 0), start)
        tokens = self.proposer.propose(seq, k) if k > 0 else []
        if rejoin_guess and not tokens:
            return Guess(
                rejoin_guess, seq.prediction_acceptance, DraftSource.PREDICTION, len(rejoin_guess), rejoin_start
            )
        return Guess(tokens, seq.acceptance, DraftSource.FREE, len(tokens), start)

    def _plan(self, seq: Sequence, guess: Guess) -> RowPlan:
        """What the row offers the policy this step; a draft model's row also what its catch-up reads first and
        what its output may still gain."""
        if guess.source != DraftSource.MODEL or not guess.available:
            return RowPlan(guess.acceptance, guess.available, guess.source == DraftSource.MODEL)
        behind = self.draft_model.behind(seq)
        return RowPlan(guess.acceptance, guess.available, True, behind, seq.limit - seq.produced)

    @property
    def drafts_trees(self) -> bool:
        """Whether this engine may draft trees: from a draft model that grows them, through a target whose passes
        all run eagerly (a compiled pass or CUDA graphs attend chains only, and round otherwise than the eager pass a
        tree would take, so a tree beside them would change the output), and not followed by an observer (it reads
        the features of chains)."""
        return (
            hasattr(self.draft_model, "propose_tree")
            and self.target.fast_pass is None
            and self.observer is None
            and self.free is None
            and self.config.tree_branches != 1
        )

    def _trees_possible(self, batch: list[Sequence], guesses: list[Guess]) -> bool:
        """Whether this step may draft trees (``drafts_trees``): every row drafting from the draft model, free of a
        grammar and of penalties (their verification walks chains)."""
        if not self.drafts_trees:
            return False
        return all(
            g.source == DraftSource.MODEL and g.available and seq.grammar is None and not seq.params.penalties.active
            for seq, g in zip(batch, guesses)
        )

    def _drafts(self, batch, guesses: list[Guess], width: int, branches: int = 1, sure: float = 0.0) -> StepDrafts:
        """Each row's drafts (at most ``width``; a ``DraftTree`` of ``branches`` branches when more than 1) and what
        the draft model said of them where it ran (``StepDrafts``). ``sure``: a model row keeps its drafts only while
        the draft's own probability of them stays at or above it (``proposers.draft_loop``)."""
        if branches > 1:
            made = self.draft_model.propose_tree(batch, width, branches)
            return StepDrafts(made.trees, made.probs, made.trees, made.caught_up, made.first_choices)
        model_tokens, model_probs, caught_up, first = [None] * len(batch), [None] * len(batch), 0, None
        made = None
        confident = [width] * len(batch)
        if sure >= 1.0:  # no draft could pay for verifying it: the draft model's forwards would be spent for nothing
            confident = [0] * len(batch)
        elif width and any(g.source == DraftSource.MODEL and g.available for g in guesses):
            made = self.draft_model.propose(batch, width, sure)
            model_tokens, model_probs, caught_up, first = made.tokens, made.probs, made.caught_up, made.first_choices
            if made.confident is not None:
                confident = made.confident
        drafts, probs = [], []
        for seq, g, tokens, q, kept in zip(batch, guesses, model_tokens, model_probs, confident):
            k = min(width, g.available) if seq.fault is None else 0  # (drafting may have faulted a row's grammar)
            if g.source == DraftSource.MODEL:
                k = min(k, kept)
                if seq.grammar is not None and k:  # masked while drafted: only what follows an end token is cut
                    try:
                        k = seq.grammar.valid_prefix(tokens[:k])
                    except Exception as exc:  # noqa: BLE001 - the row ends after the pass
                        record_fault(seq, "grammar", exc)
                        k = 0
                drafts.append(tokens[:k] if k else [])
                probs.append(q[:k] if q is not None and k else None)
            else:
                drafts.append(g.tokens[:k])
                probs.append(None)
        if first is not None:  # only a model row's first draft is its first choice
            first = [f if g.source == DraftSource.MODEL else None for f, g in zip(first, guesses)]
        if made is None:
            return StepDrafts(drafts, probs, model_tokens, caught_up, first)
        return StepDrafts(
            drafts, probs, model_tokens, caught_up, first, made.chains, made.forwards, made.forward_seconds
        )

    def _draft_threshold(self, batch: int) -> float:
        if not (self.config.cut_unsure_drafts and self.policy.adaptive) or self.draft_model is None:
            return 0.0  # a fixed width drafts all it asks
        return self.policy.draft_threshold(batch)

    def _tree_row(
        self, seq: Sequence, guess: Guess, tree: DraftTree, scores, rows: slice, argmax, first_choices
    ) -> StepOutput:
        """A row that verified a draft tree: the branch the target agrees with, moved where a chain would have left
        it in the target's cache, then advanced as the chain it stands for."""
        try:
            sampling = seq.sampling
            if sampling.greedy:
                path, token = verify_tree_greedy(tree, argmax[rows])
            else:
                target_probs = probs_from_logits(scores.logits(rows).float(), sampling)  # [nodes + 1, vocab]
                if sampling.seed is not None:
                    path, token = verify_tree_seeded(tree, target_probs, sampling.seed, seq.produced)
                else:
                    path, token = verify_tree_sampled(tree, target_probs, seq.generator)
            self.target.keep_path(seq.row, len(seq.tokens) - 1, [0] + [node + 1 for node in path])
            chain, n = tree.branch(path), len(path)
            emitted = chain[:n] + [token]
            at = [rows.start] + [rows.start + node + 1 for node in path]  # the stream positions that emitted them
            logprobs = self._logprobs(seq, emitted, lambda: scores.logits(rows)[[i - rows.start for i in at]])
            if first_choices is not None:
                self.policy.observe_first_choices(first_choices, emitted[0])
            return self._advance(seq, guess, chain, n, token, tree, logprobs)
        except Exception as exc:  # noqa: BLE001 - this row's sampling or proposer: it ends alone
            return self._failed(seq, "sampling", exc)

    def _accept(
        self, seq: Sequence, drafts: list[int], draft_probs, logits, rows: slice, argmax: list[int], allowed=None
    ):
        """(accepted, the target's token after them). rows: this row's k + 1 tokens in the pass; argmax: the pass's
        greedy choices; logits(rows) -> [k + 1, vocab], asked for only when the row samples; allowed: the row's
        grammar masks [k + 1, vocab] when already computed."""
        sampling, grammar, penalties = seq.sampling, seq.grammar, seq.params.penalties
        if sampling.greedy and not penalties.active:
            if grammar is None:
                return verify_greedy(drafts, argmax[rows])
            return self._greedy_in_grammar(
                grammar, drafts, argmax[rows], lambda j: logits(slice(rows.start + j, rows.start + j + 1))[0]
            )
        target_logits = logits(rows).float()  # [k + 1, vocab]
        if penalties.active:
            target_logits = apply_penalties(
                penalties, target_logits, seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :], drafts
            )
        if grammar is not None:
            allowed = grammar.masks(drafts) if allowed is None else allowed  # [k + 1, vocab]
            target_logits = target_logits.masked_fill(~allowed.to(target_logits.device), float("-inf"))
        if sampling.greedy:
            return verify_greedy(drafts, greedy(target_logits).tolist())
        target_probs = probs_from_logits(target_logits, sampling)  # [k + 1, vocab]
        if sampling.seed is not None:
            return verify_seeded(drafts, target_probs, sampling.seed, seq.produced)
        return verify_sampled(drafts, draft_probs, target_probs, seq.generator)

    @staticmethod
    def _greedy_in_grammar(grammar: RowGrammar, drafts: list[int], argmax: list[int], logits) -> tuple[int, int]:
        """``verify_greedy`` against the masked target, asking for masks only where needed: where the grammar allows
        the target's own choice, that is the masked choice too (a mask only removes tokens); elsewhere, the best
        allowed token. logits(j) -> [vocab]: position j's."""
        choices: list[int] = []
        taken = 0
        for j in range(len(drafts) + 1):
            best = argmax[j]
            if not grammar.allows(best):
                row = logits(j)
                best = int(greedy(row.masked_fill(~grammar.allowed().to(row.device), float("-inf"))))
            choices.append(best)
            if j == len(drafts) or drafts[j] != best:
                break
            if grammar.complete:  # best is an end token: the row ends here, whatever the next position says
                choices.append(best)
                break
            grammar.advance([best])
            taken += 1
        grammar.rollback(taken)
        return verify_greedy(drafts, choices)

    def _logprobs(self, seq: Sequence, emitted: list[int], logits: Callable[[], torch.Tensor]):
        """logits() -> [>= len(emitted), vocab]: the row's positions, asked for only when the request wants logprobs
        (a greedy step never computes the full output layer otherwise)"""
        if seq.params.logprobs is None:
            return None
        return token_logprobs(logits()[: len(emitted)], emitted, seq.params.logprobs)

    def _advance(
        self,
        seq: Sequence,
        guess: Guess,
        drafts: list[int],
        n: int,
        token: int,
        model_drafts,
        logprobs=None,
        read: tuple = (None, None),
    ) -> StepOutput:
        """read: what the pass computed at the row's accepted positions, for a model proposer: the target's layer
        features [n + 1, F] (where it takes them) and their logits [n + 1, vocab], computed when asked."""
        emitted = drafts[:n] + [token]
        before = len(seq.tokens)
        seq.tokens.extend(emitted)
        self.target.set_length(seq.row, len(seq.tokens) - 1)
        if self.draft_model is not None:
            self.draft_model.accepted(seq, before, emitted, model_drafts, *read)
        if self.observer is not None:
            self.observer.accepted(seq, before, emitted, None, *read)
        k = len(drafts)
        if k:
            guess.acceptance.observe(n, n + (1 if n < k else 0))
            if guess.source == DraftSource.MODEL:
                self.stats.record_model(k, n)
        elif guess.tokens:  # a free guess not drafted this step still tells whether it would have been right
            guess.acceptance.observe(int(guess.tokens[0] == token), 1)
        elif guess.source == DraftSource.MODEL and guess.available:  # nothing to check: the rate ages instead
            guess.acceptance.unchecked()
        pd = k if guess.source == DraftSource.PREDICTION else 0
        pa = 0
        if seq.prediction is not None:  # not asked this step (speculation off): it follows the output passively
            start = seq.prediction.expected if guess.prediction_start is None else guess.prediction_start
            pa = seq.prediction.observe(start, n if pd else 0, token)
        gd = k if guess.source == DraftSource.GRAMMAR else 0
        return self._emit(seq, emitted, k, n, pd, pa, gd, n if gd else 0, logprobs)

    def _emit(
        self, seq: Sequence, emitted: list[int], drafted=0, accepted=0, pd=0, pa=0, gd=0, ga=0, logprobs=None, cached=0
    ) -> StepOutput:
        for i, t in enumerate(emitted):
            if t in seq.stop_ids:
                emitted, seq.finish_reason = emitted[:i], "stop"
                break
        else:
            if seq.produced >= seq.limit:
                seq.finish_reason = "length"
        if seq.grammar is not None:  # the tokens after a stop are never taken: the request ends there
            seq.grammar.advance(emitted)
            self.stats.record_grammar(gd, ga, seq.grammar.take_seconds())
        self.stats.record_row(drafted, accepted, len(emitted))
        if logprobs is not None:
            logprobs = logprobs[: len(emitted)]
        return StepOutput(emitted, seq.finish_reason, drafted, accepted, pd, pa, gd, ga, logprobs, cached_tokens=cached)

    # ---- load time ----
    @torch.inference_mode()
    def calibrate(self, context: int = 64, repeats: int = 2, measure: bool = True) -> dict:
        """Measure passes over n tokens (and a draft model's or head's forwards over B rows) once, so the policy starts
        from real numbers. Also warms up the kernels, so the first request does not pay for lazy initialisation.
        ``measure=False`` only warms up (each shape once), for a policy whose costs were kept from an earlier load
        (and restored before this), measuring only a draft's forward those costs lack."""
        draft_repeats = repeats
        if not measure:
            repeats = 0
        rows = self.target.max_rows
        widest = 1 + self.policy.max_k
        vocab = self.target.vocab_size or 256
        prompt = [(i * 7919) % min(vocab, 1000) for i in range(context)]
        self.target.forward(0, [prompt] * rows, last_only=True)
        # (rows, tokens a row): every width one request can verify (kernels take rows in blocks, so costs step), then
        # batch passes of up to the widest
        shapes = {(1, n) for n in range(1, widest + 1)}
        for n in {2**i for i in range(10)} | {rows, rows * widest}:
            if widest < n <= rows * widest:
                b = min(rows, n)
                shapes.add((b, n // b))
        for b, s in sorted(shapes, key=lambda shape: shape[0] * shape[1]):
            best = float("inf")
            for _ in range(repeats + 1):  # the first run of a new shape warms it up
                t0 = time.perf_counter()
                self.target.score(0, [prompt[:s]] * b).argmax()  # as a step takes it
                best = min(best, time.perf_counter() - t0)
                for r in range(b):
                    self.target.set_length(r, context)
            if measure:
                self.policy.verify_cost.samples[b * s] = best
        if self.drafts_trees:
            # a pass over draft trees at the sizes the policy weighs: a row's tree of 2..4 branches, 1 or K deep
            shapes = {(b, branches, w) for b in {1, rows} for branches in (2, 4) for w in {1, widest - 1}}
            for b, branches, w in sorted(s for s in shapes if 1 + s[1] * s[2] <= min(MAX_TREE_TOKENS, context)):
                tree = _ancestry(DraftTree.grown(branches, w))
                best = float("inf")
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    self.target.score(0, [prompt[: len(tree)]] * b, trees=[tree] * b).argmax()
                    best = min(best, time.perf_counter() - t0)
                    for r in range(b):
                        self.target.set_length(r, context)
                if measure:
                    self.policy.tree_cost.samples[b * len(tree)] = best
        if self.draft_model is not None:
            # kept costs may predate the draft (a learning deployment's head that came later): unmeasured, its forward
            # would be priced at a second and never draft
            if measure or not self.policy.draft_cost.samples:
                self.draft_model.calibrate(
                    self.policy.draft_cost, rows, prompt, draft_repeats, catch_up=self.policy.catch_up_cost
                )
            else:
                self.draft_model.calibrate(CostModel(), rows, prompt, 0)
        for r in range(rows):
            self.target.set_length(r, 0)
        return self.policy.snapshot()


def _ancestry(drafts) -> tuple[int, ...] | None:
    """A row's tree as the verify pass reads it (its last accepted token first, then the tree), or None for a chain."""
    if not isinstance(drafts, DraftTree):
        return None
    return (-1,) + tuple(parent + 1 for parent in drafts.parents)
