"""Proposers: cheap guesses of the next tokens.

Two kinds:

- a **free** proposer (n-gram lookup; suffix speculation over recent traffic; a request's predicted output, see
  ``PredictionTracker``) looks at a row's tokens and returns up to ``k`` guesses: ``propose(seq, k) -> list[int]``.
  Computing its guess costs nothing next to a forward pass, so the engine asks before it decides how long this step's
  drafts are.
- a **draft model** costs a forward per drafted token, batched over the running rows:
  ``propose(batch, width) -> ModelDrafts``; it owns a KV cache with the same rows as the target's, each holding a
  prefix of the row's tokens (``set_length`` and ``move_row`` keep them in step). A row's prompt is read when the
  row first drafts, so where the policy does not draft the draft model costs nothing. An EAGLE head
  (``depctl_runtime.speculation.eagle``) is a model proposer too, drafting from the target's own layer outputs.

Draft probabilities are ``None`` for a deterministic (one-hot) guess.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol, Sequence, Union

import numpy as np
import torch

from depctl_runtime.model.runner import ModelRunner, greedy
from depctl_runtime.speculation.faults import record_fault
from depctl_runtime.speculation.sampling import probs_from_logits
from depctl_runtime.speculation.suffix import SuffixIndex
from depctl_runtime.speculation.verify import DraftTree

CONTEXT_LOOKBACK = 64  # how far back a candidate match's agreement with the current suffix is measured
# candidates up to this many are scored by comparing slices of the token list; more (an indent that recurs all through
# a file of code) in one array pass, whose fixed cost (the list converted whole, a [candidates, lookback] gather) is
# 50-120 us a call against a few us a candidate for the slices
SLICED_CANDIDATES = 16


def _agreement(ref: np.ndarray, ends: np.ndarray, context: np.ndarray, lookback: int) -> np.ndarray:
    """For each candidate end ``ends[c]`` in ``ref``, how many tokens counting back from it equal the end of
    ``context`` (up to ``lookback``), in one [candidates, lookback] pass: this runs for every row of every step,
    drafting or not, so it is vectorised."""
    back = np.arange(lookback)  # [L]
    positions = ends[:, None] - back[None, :]  # [C, L]
    same = (positions >= 0) & (ref[np.maximum(positions, 0)] == context[len(context) - 1 - back][None, :])
    return np.cumprod(same, axis=1).sum(axis=1)  # [C]: leading run of agreement


def ngram_propose(tokens: Sequence[int], n: int, k: int) -> list[int]:
    """Prompt-lookup decoding (Saxena 2023): find an earlier occurrence of the last ``n`` tokens and propose the
    (up to ``k``) tokens that followed it; with no occurrence, nothing (the engine then runs a plain step).

    Among the occurrences, the one whose preceding tokens agree longest with the text before the suffix wins (up
    to ``CONTEXT_LOOKBACK`` tokens; the most recent on a tie). When the output copies a block of the prompt, that
    is the aligned place in the block rather than the latest line that happens to end the same way (a newline and
    an indent match everywhere in code). ``n`` is a minimum: shorter matches (a single common token) mostly
    propose junk, so there is no fall-back to shorter suffixes. The continuation may run into the suffix itself
    (a repeating pattern keeps proposing itself), but never past the end of ``tokens``.
    """
    return NgramIndex(n).propose(tokens, k)


REJOIN_NEAR = 16  # tokens either side of the divergence where one agreeing token rejoins
REJOIN_FAR = 3  # agreement needed to rejoin anywhere else in the prediction (as n-gram lookup's n)


def rejoin(generated: Sequence[int], reference: Sequence[int], last: int) -> int:
    """Where the output rejoins ``reference`` after leaving it at ``last`` (the reference token it did not follow):
    the index in ``reference`` of the next token, or -1.

    An edit inserts, deletes or replaces a few tokens, so the output comes back close to where it left. Every
    occurrence in ``reference`` of the output's last token is scored by how many output tokens before it agree
    (up to ``CONTEXT_LOOKBACK``); the agreement an occurrence needs grows with its distance ``d`` from ``last``: one
    token within ``REJOIN_NEAR`` tokens (the output wrote its own tokens and came back, or skipped a few), and
    ``REJOIN_FAR`` anywhere else (an edit that dropped or moved a block). The longest agreement wins, then forward
    before backward (edits move on through the text), then the nearest. A wrong guess costs one verify pass, which
    on a CPU costs little more than a plain step; a right one saves up to K steps, so near the divergence one
    agreeing token is enough.
    """
    if not generated or not reference:
        return -1
    ref = np.asarray(reference, dtype=np.int64)
    gen = np.asarray(generated, dtype=np.int64)
    ends = np.flatnonzero(ref == gen[-1])  # the last output token's occurrences in the reference
    if ends.size == 0:
        return -1
    agree = _agreement(ref, ends, gen, min(CONTEXT_LOOKBACK, len(gen)))
    starts = ends + 1
    d = starts - last
    need = np.where(np.abs(d) <= REJOIN_NEAR, 1, REJOIN_FAR)
    ok = (agree >= need) & (starts < len(ref))
    if not ok.any():
        return -1
    # longest agreement, then forward, then nearest (np.lexsort's last key is the primary one)
    order = np.lexsort((np.abs(d)[ok], (d < 0)[ok], -agree[ok]))
    return int(starts[ok][order[0]])


class PredictionTracker:
    """Predicted outputs: draft from text the client expects the answer to contain (an edited file, say).

    ``expected`` is the index in the prediction of the next token while the output follows it; the first step
    proposes the prediction's start. When the output leaves the prediction (the edit), ``rejoin`` guesses where
    it comes back (tokens inserted, deleted or replaced); the engine drafts that guess when the deployment's own
    proposer has nothing (``following`` tells a guess from a continuation), and once the output agrees with the
    prediction again drafting continues from there.
    """

    def __init__(self, prediction: Sequence[int]):
        self.prediction = list(prediction)
        self.expected = 0
        self.left_at = 0  # where the output last left the prediction (the token it did not follow)
        self.matched = 0  # output tokens that followed the prediction: accepted drafts and agreeing target tokens

    def propose(self, generated: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(start, tokens): where in the prediction the guess starts (-1: nowhere) and up to ``k`` tokens from there.
        The caller hands ``start`` back to ``observe`` with the step's outcome."""
        start = self.expected
        if start < 0:
            start = rejoin(generated, self.prediction, self.left_at)
        if not 0 <= start < len(self.prediction):
            return -1, []
        return start, self.prediction[start : start + k] if k > 0 else []

    @property
    def following(self) -> bool:
        """The output is on the prediction: ``propose`` continues it (rather than guessing where it rejoins)."""
        return self.expected >= 0

    def observe_first(self, token: int) -> int:
        """The prefill's token (no drafts): 1 when it is the prediction's start."""
        return self.observe(self.expected, 0, token)

    def observe(self, start: int, accepted: int, next_token: int) -> int:
        """After verification of a guess that started at ``start`` (-1: the step did not follow the prediction):
        follow the prediction while the target's own token agrees with it.

        Returns how many of the step's output tokens came from the prediction."""
        pos = start + accepted if start >= 0 else -1
        if 0 <= pos < len(self.prediction) and self.prediction[pos] == next_token:
            self.expected = pos + 1
            self.matched += accepted + 1
            return accepted + 1
        if pos >= 0:  # it left the prediction here (a step that did not follow it keeps the old place)
            self.left_at = pos
        self.expected = -1
        self.matched += accepted
        return accepted


class FreeProposer(Protocol):
    """``seq`` is the request (``seq.id``, ``seq.tokens``: prompt + output); ``finish(seq)`` runs when it leaves."""

    name: str

    def propose(self, seq, k: int) -> list[int]: ...

    def finish(self, seq) -> None: ...


class NgramIndex:
    """``ngram_propose`` over one request's tokens, which only grow, at a cost that does not grow with them.

    Every n-gram of the tokens is kept with the positions where it ends, each added once as the tokens arrive. The
    candidates ``ngram_propose`` keeps (earlier occurrences of the last n tokens) are then one dictionary lookup; only
    they are scored, with the same agreement, so the guess is the same. The lookup runs for every row of every step,
    drafting or not: at batch 8 on chat prompts, where the policy mostly decides against drafting, a scan of the
    whole request each step was ~2% of the step."""

    def __init__(self, n: int):
        self.n = n
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions of its last token, ascending
        self.next_end = n - 1  # the next position to index as an n-gram's end
        self.length = 0  # the token count at the last call

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n, length = self.n, len(tokens)
        if length < self.length:  # not the tokens this index was built over (they only grow): start again
            self.ends.clear()
            self.next_end = n - 1
        self.length = length
        for end in range(self.next_end, length - 1):  # an occurrence must end before the last token
            self.ends.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end)
        self.next_end = max(self.next_end, length - 1)
        if k <= 0 or length < n + 1:  # ngram_propose's agreement looks back at most length - 1 tokens
            return []
        ends = self.ends.get(tuple(tokens[length - n :]))
        if not ends:
            return []
        if len(ends) == 1:  # a lone occurrence wins whatever its agreement (and it agrees in n tokens at least)
            return list(tokens[ends[0] + 1 : ends[0] + 1 + k])
        lookback = min(CONTEXT_LOOKBACK, length - 1)
        if len(ends) <= SLICED_CANDIDATES:
            tokens = tokens if isinstance(tokens, list) else list(tokens)
            agree = [_sliced_agreement(tokens, e, n, lookback) for e in ends]
            best = max(agree)
            end = ends[len(agree) - 1 - agree[::-1].index(best)]  # the most recent of the longest
        else:
            arr = np.asarray(tokens, dtype=np.int64)
            agree = _agreement(arr, np.asarray(ends), arr, lookback)
            end = ends[int(np.flatnonzero(agree == agree.max())[-1])]
        return list(tokens[end + 1 : end + 1 + k])


def _sliced_agreement(tokens: list[int], end: int, n: int, lookback: int) -> int:
    """``_agreement`` of one candidate ``end`` whose last ``n`` tokens equal the list's: the longest m (up to
    ``lookback``, and ``end + 1``) with ``tokens[end - m + 1 : end + 1]`` equal to the last m tokens, found by
    halving (slices that agree in m tokens agree in every fewer), each test one list comparison."""
    hi = min(lookback, end + 1)
    length = len(tokens)
    if tokens[end - hi + 1 : end + 1] == tokens[length - hi :]:
        return hi
    lo = n  # the n-gram itself agrees (and hi, which does not, is longer)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens[end - mid + 1 : end + 1] == tokens[length - mid :]:
            lo = mid
        else:
            hi = mid
    return lo


class NgramProposer:
    name = "ngram"

    def __init__(self, ngram_length: int):
        self.ngram_length = ngram_length
        self._indexes: dict[int, NgramIndex] = {}  # per running request

    def propose(self, seq, k: int) -> list[int]:
        index = self._indexes.get(seq.id)
        if index is None:
            index = self._indexes[seq.id] = NgramIndex(self.ngram_length)
        return index.propose(seq.tokens, k)

    def finish(self, seq) -> None:
        self._indexes.pop(seq.id, None)


class SuffixProposer:
    """Suffix speculation over this deployment's recent traffic (``speculation.suffix``): each request's tokens
    are indexed as it runs (the new tail, every step it drafts, and all of it when it finishes). With ``scope``
    "user" a request drafts only from requests with its API key and ``user`` field; "deployment" shares one index."""

    name = "suffix"

    def __init__(self, cache_tokens: int, scope: str = "user"):
        self.index = SuffixIndex(cache_tokens)
        self.scope = scope

    def _salt(self, seq) -> int:
        return 0 if self.scope == "deployment" else hash(seq.params.tenant) or 1  # 0 is the shared index's

    def propose(self, seq, k: int) -> list[int]:
        salt = self._salt(seq)
        self.index.sync(seq.id, seq.tokens, salt)
        return self.index.propose(seq.tokens, k, salt)[0]

    def finish(self, seq) -> None:
        self.index.sync(seq.id, seq.tokens, self._salt(seq))
        self.index.finish(seq.id)

    def snapshot(self) -> dict:
        return {**self.index.snapshot(), "scope": self.scope}


TOP_CHOICES = 4  # the draft's first choices kept at a chain's first position: how often a tree would have caught more


class ModelDrafts(NamedTuple):
    tokens: list[list[int]]  # [B][passes]: a row's token at each position drafted (a tree's in its order)
    probs: list[torch.Tensor | None]  # per row [passes, vocab]; None for a greedy row (one-hot)
    caught_up: int  # the most tokens a row fed before drafting: 1 or 2 when it drafted last step, more after a gap
    trees: list[DraftTree] | None = None  # per row, when the draft drafted trees
    first_choices: list[list[int]] | None = None  # per row, the draft's TOP_CHOICES best at the first position
    confident: list[int] | None = None  # per row, the drafts worth verifying (``draft_loop``'s min_confidence)
    chains: list[list[float]] | None = None  # per row, the draft's probability of its chain up to each draft
    forwards: int = 0  # forwards run after the first position's (``draft_loop``)
    forward_seconds: float = 0.0  # and what they cost, the drafting around them included


class ModelProposer(Protocol):
    """A proposer that runs a model per drafted token, batched over rows 0..B-1 (a draft model, an EAGLE head). It
    keeps state per row in step with the target's rows: ``accepted`` after each verify, ``prefilled`` after each prompt
    chunk (both for every running sequence, drafting or not, with the target's layer features of the positions the
    pass read, where it takes them, and their logits computed when asked: a prompt chunk's last position's only),
    ``set_length`` when a row is cut (0: released), ``move_row`` when the scheduler compacts rows."""

    name: str
    steady_catch_up: int  # tokens a row catches up on in a step after a drafting step (costs are measured there)

    def propose(self, batch, width: int, min_confidence: float = 0.0) -> ModelDrafts: ...

    def prefilled(self, seq, start: int, features: torch.Tensor | None, logits=None) -> None: ...

    def accepted(
        self,
        seq,
        before: int,
        emitted: list[int],
        drafted: list[int] | None,
        features: torch.Tensor | None,
        logits=None,
    ) -> None: ...

    def set_length(self, row: int, length: int) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...

    def behind(self, seq) -> int: ...  # tokens of ``seq`` its next draft reads before drafting (its catch-up)

    def calibrate(self, cost, rows: int, prompt: list[int], repeats: int = 2, catch_up=None) -> None: ...

    def release(self) -> None: ...


class FeatureObserver(Protocol):
    """Sees what the target computed for every sequence, drafting or not, as a ``ModelProposer`` does (``prefilled``,
    ``accepted``: the layer features of the positions each pass read), and each sequence's end (``finished``); it
    never drafts. A learning head's traffic capture (``depctl_runtime.training.traffic``)."""

    needs_prompt_features: bool

    def prefilled(self, seq, start: int, features: torch.Tensor | None, logits=None) -> None: ...

    def accepted(self, seq, before: int, emitted, drafted, features: torch.Tensor | None, logits=None) -> None: ...

    def finished(self, seq) -> None: ...


class Drafted(NamedTuple):
    """What ``draft_loop`` drafted: per row its tokens, their draft probabilities (None: greedy), and with a
    confidence asked, how many are worth verifying and the chain's probability at each; the forwards it ran after
    the first position and their cost (the policy prices a step's first position and each later one apart)."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    confident: list[int] | None = None
    chains: list[list[float]] | None = None
    forwards: int = 0
    forward_seconds: float = 0.0


class DraftVocabulary:
    """A proposer's own vocabulary (an EAGLE head's few thousand most frequent tokens): column j of its logits is the
    target's token ``ids[j]``. Greedy rows draft within it; rows that sample or follow a grammar read its logits
    spread over the target's vocabulary (-inf elsewhere), where their distributions and masks live."""

    def __init__(self, ids: torch.Tensor, size: int):
        self.ids, self.size = ids, size

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, len(ids)] -> [B, size]."""
        full = logits.new_full((logits.shape[0], self.size), float("-inf"))
        full[:, self.ids] = logits
        return full


def draft_loop(
    batch,
    width: int,
    logits: torch.Tensor,
    step,
    min_confidence: float = 0.0,
    vocabulary: DraftVocabulary | None = None,
) -> Drafted:
    """The drafting both model proposers run: ``width`` tokens for each of rows 0..B-1, chosen from logits
    [B, vocab] greedily or sampled as the row samples (keeping the draft probabilities rejection sampling needs),
    within the row's grammar up to an end token; ``step(tokens [B]) -> logits [B, vocab]`` runs the proposer once more.
    The last token is never stepped: the target checks it, and catch-up feeds it if accepted. With ``vocabulary`` the
    logits are over the proposer's own (tokens are still the target's): a batch of greedy rows drafts within it, an
    argmax and a softmax over its columns instead of the target's whole vocabulary each position.

    With ``min_confidence``, each row's drafts are worth verifying only while the draft's own probability of its
    chain so far (the product of each drafted token's probability) stays at or above it; ``confident`` says how
    many a row has and ``chains`` its chain's probability at each draft (None without), and drafting stops early
    once no row has any left. The choice uses the draft's probabilities alone, so the output is the target's
    whatever is cut (as for any draft length)."""
    drafted: list[torch.Tensor] = []  # width tensors of shape [B]; on the device until the end
    probs: list[list[torch.Tensor]] = [[] for _ in batch]  # per row, width tensors of [vocab]
    chain = torch.ones(len(batch), device=logits.device) if min_confidence > 0 else None
    sure: list[torch.Tensor] = []  # per position, [B]: the row's chain is still confident there
    chains: list[torch.Tensor] = []  # per position, [B]: the chain's probability up to there
    # drafts are proposed within a row's grammar (they are then never cut), up to an end token
    taken = {b: 0 for b, seq in enumerate(batch) if seq.grammar is not None}  # tokens each matcher advanced
    forwards, later = 0, 0.0  # the forwards after the first position, and when the first of them began
    ids = None  # the target's token at each column of the logits, where they are the proposer's own
    if vocabulary is not None:
        if taken or any(not seq.sampling.greedy for seq in batch):
            logits, proposer_step = vocabulary.spread(logits), step
            step = lambda token: vocabulary.spread(proposer_step(token))  # noqa: E731
        else:
            ids = vocabulary.ids
    for i in range(width):
        if taken:
            logits = logits.clone()
            for b in list(taken):
                grammar = batch[b].grammar
                try:
                    if i:
                        token = int(drafted[-1][b])
                        if token in batch[b].stop_ids or not grammar.allows(token):
                            grammar.rollback(taken.pop(b))
                            continue
                        grammar.advance([token])
                        taken[b] += 1
                    logits[b].masked_fill_(~grammar.allowed().to(logits.device), float("-inf"))
                except Exception as exc:  # noqa: BLE001 - that row ends after the pass; the others draft on
                    record_fault(batch[b], "grammar", exc)
                    del taken[b]
        column = greedy(logits)  # [B]
        token = column if ids is None else ids[column]
        for b, seq in enumerate(batch):
            if not seq.sampling.greedy and seq.fault is None:
                try:
                    q = probs_from_logits(logits[b : b + 1], seq.sampling)  # [1, vocab]
                    token[b] = torch.multinomial(q[0], 1, generator=seq.generator)[0]
                except Exception as exc:  # noqa: BLE001 - that row ends after the pass; its drafts are dropped
                    record_fault(seq, "sampling", exc)
                    continue
                probs[b].append(q[0])
        drafted.append(token)
        if chain is not None:
            chain = chain * _drafted_probability(batch, logits, column, probs, i)
            chains.append(chain)
            sure.append(chain >= min_confidence)
            if not bool(sure[-1].any()):  # no row would verify another draft: stop stepping the proposer
                break
        if i + 1 < width:
            if not forwards:
                later = time.perf_counter()
            logits = step(token)
            forwards += 1
    for b, n in taken.items():
        batch[b].grammar.rollback(n)  # (a faulted row's matcher is never used again)
    tokens = torch.stack(drafted, 1).tolist() if drafted else [[] for _ in batch]  # one host sync
    confident = torch.stack(sure, 1).cumprod(1).sum(1).tolist() if sure else None
    kept = torch.stack(chains, 1).tolist() if chains else None
    later = time.perf_counter() - later if forwards else 0.0  # (after the sync: a device's forwards are done)
    return Drafted(tokens, [torch.stack(p) if p else None for p in probs], confident, kept, forwards, later)


def _drafted_probability(batch, logits: torch.Tensor, column: torch.Tensor, probs, i: int) -> torch.Tensor:
    """[B]: the probability each row's draft at position ``i`` (``column`` of the logits; for a sampled row, its
    token) had under the distribution it was drawn from (the greedy rows': the softmax of the logits, whose largest
    it is)."""
    p = torch.softmax(logits.float(), -1).gather(1, column[:, None])[:, 0]
    for b, seq in enumerate(batch):
        if len(probs[b]) > i:  # a sampled row's own distribution (temperature, top-k, top-p)
            p[b] = probs[b][i][column[b]]
    return p


class DraftModelProposer:
    """A small model with the target's tokenizer drafts autoregressively, for every running row at once."""

    name = "draft_model"
    catch_up_chunk = 128  # tokens a row reads alone before the batched catch-up: one row's prompt does not widen all
    steady_catch_up = 2  # the last accepted token, and d_k after a full accept

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def set_length(self, row: int, length: int) -> None:
        self.runner.set_length(row, min(length, self.runner.length(row)))

    def move_row(self, src: int, dst: int) -> None:
        self.runner.move_row(src, dst)

    def behind(self, seq) -> int:
        return len(seq.tokens) - self.runner.length(seq.row)

    def prefilled(self, seq, start: int, features: torch.Tensor | None, logits=None) -> None:
        pass  # a row's prompt is read when it first drafts

    def accepted(
        self,
        seq,
        before: int,
        emitted: list[int],
        drafted: list[int] | None,
        features: torch.Tensor | None,
        logits=None,
    ) -> None:
        """The row's tokens were ``before`` long and grew by ``emitted``; the draft had fed them and its own
        ``drafted[:-1]`` (a tree: every depth but the last): it keeps those that the output agrees with."""
        if drafted is None:
            return
        if isinstance(drafted, DraftTree):
            fed = max(drafted.depths, default=0) - 1
            path = drafted.follow(emitted[:fed])
            self.runner.keep_path(seq.row, before, path)
            self.set_length(seq.row, before + len(path))
            return
        # the last emitted token is fed at the next draft (its logits draft d_1), even where the draft had fed it
        # already: a draft cut short for its confidence can be right past the cut, where the target's own token lands
        agree = 0
        while agree < len(drafted) and agree < len(emitted) - 1 and drafted[agree] == emitted[agree]:
            agree += 1
        self.set_length(seq.row, before + agree)

    def release(self) -> None:
        self.runner.release()

    @torch.inference_mode()
    def propose(self, batch, width: int, min_confidence: float = 0.0) -> ModelDrafts:
        """``width`` drafts for each of rows 0..B-1 (``batch[b]`` has ``tokens``, ``sampling``, ``generator``), as
        far as ``min_confidence`` finds them worth verifying (``draft_loop``)."""
        runner = self.runner
        logits, caught_up = self._catch_up(batch)
        first = logits.topk(min(TOP_CHOICES, logits.shape[-1]), -1).indices  # synced with the drafts
        step = lambda token: runner.forward(0, token[:, None])  # noqa: E731
        drafted = draft_loop(batch, width, logits, step, min_confidence)
        return ModelDrafts(
            drafted.tokens,
            drafted.probs,
            caught_up,
            first_choices=first.tolist(),
            confident=drafted.confident,
            chains=drafted.chains,
            forwards=drafted.forwards,
            forward_seconds=drafted.forward_seconds,
        )

    def _catch_up(self, batch) -> tuple[torch.Tensor, int]:
        """Feed each row what it has not read: normally the last accepted token; after a full accept also d_k, which
        was never fed; more after steps that did not draft. The logits after each row's last token [B, vocab], and
        the most tokens a row fed."""
        runner = self.runner
        pending = [list(seq.tokens[runner.length(b) :]) for b, seq in enumerate(batch)]
        caught_up = max(map(len, pending))
        for b, tokens in enumerate(pending):  # a prompt (read lazily) or a long gap: a prefill of the row alone
            while len(tokens) > self.catch_up_chunk:
                runner.forward(b, [tokens[: self.catch_up_chunk]], last_only=True, prefill=True)
                del tokens[: self.catch_up_chunk]
        return runner.forward(0, pending, last_only=True), caught_up

    @torch.inference_mode()
    def propose_tree(self, batch, width: int, branches: int) -> ModelDrafts:
        """A tree for each of rows 0..B-1: the draft's ``branches`` best tokens at the first position, then a greedy
        chain under each, ``width`` deep in all. Every candidate is a one-hot draft (``verify_tree_sampled`` for
        sampling rows). The draft reads the tree a depth a pass (``ModelRunner.score`` with ``trees``). For rows
        without a grammar (the engine drafts chains for those)."""
        runner = self.runner
        logits, caught_up = self._catch_up(batch)
        first = logits.topk(min(max(branches, TOP_CHOICES), logits.shape[-1]), -1).indices  # [B, >= branches]
        level = first[:, :branches]  # [B, branches]: the tokens at the depth just drafted
        levels, rows = [level], len(batch)
        for depth in range(1, width):  # the tree so far, its last depth new in this pass
            grown = DraftTree.grown_parents(branches, depth)
            level = greedy(runner.score(0, level, trees=[grown] * rows).logits()).reshape(rows, branches)
            levels.append(level)
        tokens = torch.cat(levels, 1).tolist()  # [B, branches * width]: depth by depth, one host sync
        trees = [DraftTree.grown(branches, width, row) for row in tokens]
        return ModelDrafts(tokens, [None] * len(batch), caught_up, trees, first[:, :TOP_CHOICES].tolist())

    @torch.inference_mode()
    def calibrate(self, cost, rows: int, prompt: list[int], repeats: int = 2, catch_up=None) -> None:
        """A forward's cost over 1 and ``rows`` rows into ``cost`` (a ``policy.CostModel``), and into ``catch_up`` what
        reading ``prompt`` into one row costs (a drafting step's start after a gap); leaves every row empty."""
        runner = self.runner
        if catch_up is not None:
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                greedy(runner.forward(0, [prompt], last_only=True)).tolist()
                best = min(best, time.perf_counter() - t0)
                runner.set_length(0, 0)
            catch_up.samples[len(prompt)] = best
        runner.forward(0, [prompt] * rows, last_only=True)
        for b in sorted({1, rows}):
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                greedy(runner.forward(0, [prompt[:1]] * b)).tolist()
                best = min(best, time.perf_counter() - t0)
                for r in range(b):
                    runner.set_length(r, len(prompt))
            cost.samples[b] = best
        for r in range(rows):
            runner.set_length(r, 0)


Proposer = Union[NgramProposer, SuffixProposer, FreeProposer, ModelProposer]
