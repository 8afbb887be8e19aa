"""ModelRunner: one model plus the one KV cache it owns (a ``SlotCache``: a row per running sequence).

A forward takes a contiguous range of rows and a list of new tokens per row (ragged, not padded: the model sees one
flat stream of all of them), writes them at each row's length, and returns their logits. The engine keeps one invariant
with ``set_length`` after every
step, for the target and the draft alike: a row holds a prefix of its accepted sequence, and for the target exactly
``len(tokens) - 1`` positions, so that the last accepted token is the next forward's first input. A draft row may be
*shorter* (after a full accept it never saw ``d_k``); it catches up by feeding ``tokens[length:]`` next time.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from typing import Protocol

import torch

from depctl_runtime.kernels.surgery import Int8WeightLinear, prefill_pass
from depctl_runtime.model import decoder
from depctl_runtime.model.attention import NAME as ROWS_ATTENTION
from depctl_runtime.model.cache import SlotCache
from depctl_runtime.model.screened_head import ScreenedHead


def held_bytes(*roots: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (runners, models, caches) through modules,
    containers and the attributes of depctl's, transformers' and torch's own objects: the weights as held (packed
    ones included) and the KV cache. A tokenizer or config is never walked."""
    seen, storages, stack = set(), {}, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's packed weights)
                storages[("opaque", id(obj))] = obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(_WALKED):
            stack.extend(vars(obj).values())
    return sum(storages.values())


_WALKED = ("depctl_runtime.", "transformers.models.", "transformers.cache_utils", "torch.nn.")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...]: each row's greedy token, the first index of its largest logit (``argmax``'s choice, ties
    and NaN alike). ``max`` finds it several times faster than ``argmax`` on a CPU."""
    return logits.max(-1).indices


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int | None = None,
        max_rows: int = 1,
        max_context: int | None = None,
        slack: int = 64,
        cache: SlotCache | None = None,
        fast_pass: FastPass | None = None,
        features: tuple[int, ...] = (),
    ):
        self.model = model
        self.device = next(model.parameters()).device
        config = (
            model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        )
        max_context = max_context or getattr(config, "max_position_embeddings", 2048)
        # Logit rows beyond the tokenizer's vocabulary are padding (Qwen pads its tables); sliced off so target
        # and draft probabilities line up.
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        # slack: a verify writes up to K + 1 positions past a row's length
        self.max_context, self.slack = max_context, slack
        self.cache = cache if cache is not None else SlotCache(model.config, max_rows, max_context + slack)
        # on a CPU, verify passes attend position by position, so that they round as plain steps do: SDPA's CPU kernels
        # round a query differently beside more queries, in float32 too (with the loader's row-invariant linears this
        # makes a 9-token verify pass bit-identical to 9 one-token steps; tests/real checks it)
        self.per_position = self.device.type == "cpu"
        # The cache's rows are read by our attention function (a ragged stream needs per-row attention). A public
        # switch, not a patch: model.generate() on the same object still runs transformers' SDPA attention.
        model.set_attn_implementation(ROWS_ATTENTION)
        # a model the loader fused (depctl_runtime.model.decoder) is stepped through our own forward, not transformers'
        self.fused = decoder.is_fused(model)
        # transformers 5.24 renamed the forward's cache argument (``past_key_values`` -> ``cache``, the old name
        # deprecated): pass it under the name this version reads
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # decode and verify passes through a compiled library or CUDA graphs, where the loader proved them exact
        self.fast_pass = fast_pass
        # the layers whose outputs every pass also returns (``Scores.features``): an EAGLE head drafts from them
        self.features = tuple(features)
        self._prefill_linears = [m for m in model.modules() if isinstance(m, Int8WeightLinear)]

    def release(self) -> None:
        """Nothing runs this runner again: its fast pass lets go, and the model's weights are emptied in place. A
        compiled library keeps an alias of every weight it borrows that torch 2.13's AOTInductor runtime never deletes
        (its headers are compiled into every library); the alias shares the storage, so emptying the storage is what
        frees the memory. An opaque oneDNN tensor or a memory-mapped one has no storage to empty (a compiled library
        borrows copies of memory-mapped weights)."""
        if self.fast_pass is not None:
            self.fast_pass.release()
        for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
            if tensor.is_mkldnn:
                continue
            storage = tensor.untyped_storage()
            if storage.resizable():
                storage.resize_(0)

    def with_pass(self, fast_pass: FastPass | None) -> ModelRunner:
        """A runner over the same model and cache whose decode and verify passes go through ``fast_pass``."""
        return ModelRunner(
            self.model,
            self.vocab_size,
            self.max_rows,
            self.max_context,
            self.slack,
            self.cache,
            fast_pass,
            self.features,
        )

    def set_max_width(self, width: int) -> None:
        """The most tokens a row verifies changed (``deployment update --draft-token-count``)."""
        if self.fast_pass is not None:
            self.fast_pass.set_widths((width,))

    def length(self, row: int) -> int:
        return self.cache.lengths[row]

    def set_length(self, row: int, length: int) -> None:
        self.cache.set_length(row, length)

    def move_row(self, src: int, dst: int, pending: int = 0) -> None:
        """pending: positions past the row's length that a ``PromptPass`` in progress has written (they move too)."""
        self.cache.move_row(src, dst, pending)

    def read_block(self, row: int, start: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.cache.read_block(row, start, n)

    def write_block(self, row: int, start: int, block: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache.write_block(row, start, block)

    def keep_path(self, row: int, first: int, path: list[int]) -> None:
        """After tree passes (``score`` with ``trees``): the row's accepted branch where a chain would have left it
        (``SlotCache.keep_path``)."""
        self.cache.keep_path(row, first, path)

    @torch.inference_mode()
    def forward(
        self, first: int, inputs: list[list[int]] | torch.Tensor, last_only: bool = False, prefill: bool = False
    ) -> torch.Tensor:
        """Append ``inputs[b]`` to row ``first + b`` for every b and return the logits.

        inputs: B lists of token ids (ragged), or a [B, S] tensor already on the device (no host round trip)
        returns: [T, vocab] for the flat stream of all rows' tokens (row b's are ``offsets[b]:offsets[b + 1]``,
        offsets the running sum of the input lengths), or [B, vocab] with ``last_only``: each row's last token
        prefill: the inputs are a prompt chunk, which plain and speculative decoding read alike: linears may use a
        kernel that is faster for many rows (``surgery.prefill_pass``)
        """
        scores = self.score(first, inputs, last_only, prefill)
        with (
            prefill_pass(self._prefill_linears) if prefill else contextlib.nullcontext()
        ):  # the output layer is part of the pass
            return scores.logits()

    @torch.inference_mode()
    def prefill(self, row: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt chunk into ``row``: its last token's logits [1, vocab], and the chunk's layer features
        [len(tokens), layers * hidden] (None where the runner takes none)."""
        chunk = self.begin_prefill(row, tokens)
        chunk.run()
        return chunk.result()

    @torch.inference_mode()
    def prompt_cuts_exact(self, row: int = 0) -> bool:
        """Whether a prompt read in chunks cut anywhere (within 128-token blocks, as the scheduler cuts) leaves the
        bits of reading it in whole blocks, on this machine with these products (chunk widths 1 to 15 and wider):
        what lets a prefix cache resume a prompt mid-block. The attention is built for it (``attention``: prompt
        chunks); the linears must be row-invariant at every width, which the loader's products are and a plain
        ``F.linear`` often is not below a dozen rows. Measured once per model (its products decide); uses ``row`` and
        leaves it empty, so call it while no sequence runs."""
        known = getattr(self.model, "_depctl_prompt_cuts_exact", None)
        if known is None:
            known = self._check_prompt_cuts(row)
            self.model._depctl_prompt_cuts_exact = known
        return known

    def _check_prompt_cuts(self, row: int) -> bool:
        n = min(160, self.max_context - 1)
        vocab = self.vocab_size or self.model.get_input_embeddings().num_embeddings
        tokens = [(i * 7919 + 13) % vocab for i in range(n)]
        widths = [*range(1, 16), 8, 3]  # 1 + ... + 15 + 8 = 128, then 3 and the rest (29)

        def read(cuts: list[int]) -> tuple[torch.Tensor, list]:
            self.set_length(row, 0)
            logits, start = None, 0
            for end in [*(c for c in cuts if c < n), n]:
                logits, _ = self.prefill(row, tokens[start:end])
                start = end
            return logits.clone(), self.read_block(row, 0, n)

        try:
            logits, kv = read(list(range(128, n, 128)))
            cut_logits, cut_kv = read(list(itertools.accumulate(widths)))
            return torch.equal(logits, cut_logits) and all(
                torch.equal(a, b) for pair, other in zip(kv, cut_kv) for a, b in zip(pair, other)
            )
        finally:
            self.set_length(row, 0)

    def begin_prefill(self, row: int, tokens: list[int]) -> PromptPass:
        """``prefill``, run a part of a layer at a time by the caller (``PromptPass``)."""
        return PromptPass(self, row, tokens)

    @torch.inference_mode()
    def score(
        self,
        first: int,
        inputs: list[list[int]] | torch.Tensor,
        last_only: bool = False,
        prefill: bool = False,
        trees: list[tuple[int, ...] | None] | None = None,
    ) -> "Scores":
        """``forward``, returning the pass's ``Scores``: its greedy choices, and its logits only where asked for.
        trees: per row, None for a chain, or a draft tree: each of its tokens' parent among them (-1: it sees the
        cache before the tree only), this pass adding the last ``len(inputs[b])``; every token sees the cache before
        the tree and its own ancestors (``RowLayout.ancestry``; ``keep_path`` then keeps the accepted branch)."""
        if isinstance(inputs, torch.Tensor):
            widths = [inputs.shape[1]] * inputs.shape[0]
            input_ids = inputs.reshape(1, -1)  # [1, T]
        else:
            widths = [len(x) for x in inputs]
            input_ids = torch.tensor([[t for x in inputs for t in x]], dtype=torch.long, device=self.device)
        prompt = prefill and len(widths) == 1
        # a tree grown over passes (a draft model's, which need not round as plain steps do) is attended by mask
        per_position = self.per_position and (
            trees is None or all(t is None or len(t) == w for t, w in zip(trees, widths))
        )
        layout = self.cache.begin(first, widths, self.device, per_position, prompt=prompt, ancestry=trees)
        keep = [end - 1 for end in layout.offsets[1:]] if last_only else None
        try:
            fast = self.fast_pass
            if (
                fast is not None
                and not prefill
                and not layout.has_trees  # compiled passes and CUDA graphs attend chains only
                and self.cache.allocated
                and fast.fits(first, widths, keep)
            ):
                out, features = fast(input_ids[0], layout, self.cache, keep)  # [T or len(keep), hidden or vocab]
                if fast.returns_hidden:
                    return Scores(self.model.lm_head, self.vocab_size, hidden=out, features=features)
                return Scores(self.model.lm_head, self.vocab_size, logits=out, features=features)
            position_ids = self.cache.step.positions[None]  # [1, T]
            if keep is not None:
                keep = torch.tensor(keep, device=self.device)
            with prefill_pass(self._prefill_linears) if prefill else contextlib.nullcontext():
                return self._forward(input_ids, position_ids, layout, keep)
        finally:
            self.cache.advance(first, widths)

    def _forward(self, input_ids, position_ids, layout, keep) -> "Scores":
        """keep: None, or the stream indices whose logits are wanted (Scores of [T or len(keep)] tokens)."""
        if self.fused:
            attend = decoder.cache_attention(self.cache, layout)
            hidden, features = decoder.forward_with_features(
                self.model, input_ids[0], position_ids[0], attend, keep, head=False, features=self.features
            )
            return Scores(self.model.lm_head, self.vocab_size, hidden=hidden, features=features)
        if self.features:
            raise ValueError("layer features are taken from depctl's fused decoder only (decoder.supports)")
        logits = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            depctl_rows=layout,
            logits_to_keep=0 if keep is None else keep,
            **{self.cache_kwarg: self.cache},
        ).logits[0]
        return Scores(self.model.lm_head, self.vocab_size, logits=logits)


class PromptPass:
    """A prompt chunk's pass into one row, resumable between parts of layers (``decoder.LayeredPass``): a long prompt
    is read beside running streams a little at a time, with the bits one whole pass gives. Until its last part has
    run, the row's length stays where it was and other rows may run passes of their own: the cache's step is this
    pass's only while ``run`` runs. A model stepped through transformers' own forward runs whole on the first
    ``run``."""

    def __init__(self, runner: ModelRunner, row: int, tokens: list[int]):
        self.runner, self.width = runner, len(tokens)
        cache = runner.cache
        self.layout = cache.begin(row, [len(tokens)], runner.device, runner.per_position, prompt=True)
        self.step, cache.step = cache.step, None
        self.input_ids = torch.tensor([tokens], dtype=torch.long, device=runner.device)
        self.keep = torch.tensor([len(tokens) - 1], device=runner.device)
        self.layers: decoder.LayeredPass | None = None
        if runner.fused:
            attend = decoder.cache_attention(cache, self.layout)
            self.layers = decoder.LayeredPass(
                runner.model, self.input_ids[0], self.step.positions, attend, self.keep, False, runner.features
            )
        self._result: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def row(self) -> int:
        return self.layout.first

    @property
    def done(self) -> bool:
        return self._result is not None

    @torch.inference_mode()
    def run(self, more=None) -> bool:
        """Run layers until the last, or until ``more()`` is false after one (None: to the last). Returns ``done``."""
        runner, cache = self.runner, self.runner.cache
        cache.step = self.step
        try:
            with prefill_pass(runner._prefill_linears):  # the output layer is part of the pass
                if self.layers is None:
                    scores = runner._forward(self.input_ids, self.step.positions[None], self.layout, self.keep)
                elif self.layers.run(more):
                    hidden, features = self.layers.result()
                    scores = Scores(runner.model.lm_head, runner.vocab_size, hidden=hidden, features=features)
                else:
                    return False
                self._result = (scores.logits(), scores.features)
        finally:
            cache.step = None
        cache.advance(self.row, [self.width])
        return True

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last token's logits [1, vocab] and the chunk's layer features (or None), once ``done``."""
        if self._result is None:
            raise RuntimeError("the prompt pass has not run to its last layer")
        return self._result

    def move(self, dst: int) -> None:
        """The row moved (``ModelRunner.move_row`` with this pass's ``width`` pending): the rest of the pass writes
        and reads row ``dst``. The attention holds this layout, so it changes in place."""
        self.layout.first = dst


class FastPass(Protocol):
    """A decode and verify pass faster than the eager one, proven exact against it at load: a compiled library
    (``model.compiled``) or CUDA graphs (``model.graphs``). Prompt chunks always run eagerly."""

    returns_hidden: bool  # the final norm's output (the runner applies the output layer), else logits

    def fits(self, first: int, widths: list[int], keep: list[int] | None) -> bool: ...

    def __call__(
        self, input_ids: torch.Tensor, layout, cache: SlotCache, keep: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # the output, and the runner's layer features (or None)

    def set_widths(self, widths: tuple[int, ...]) -> None: ...

    def describe(self) -> str: ...

    def release(self) -> None: ...  # nothing runs this pass again


class Scores:
    """What a pass gives the engine: each token's greedy choice (``argmax``, the step's host sync) and, for the rows
    that sample, logits (``logits``). The output layer is applied here, not in the pass: a float32 target's
    ``ScreenedHead`` chooses greedy tokens without the full float32 product (``model.screened_head``), so a greedy step
    never computes it, and a sampling row computes only its own rows (the product gives a row the same bits
    whatever rows are beside it: ``surgery.BlockedLinear``)."""

    def __init__(
        self,
        head: torch.nn.Module,
        vocab_size: int | None,
        hidden: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
    ):
        self.head, self.vocab_size = head, vocab_size
        self.features = (
            features  # [T, layers * hidden] where the runner takes layer features (every token, keep or not)
        )
        self.hidden = hidden  # [T, hidden], the final norm's output; None where the model's own forward ran
        self._logits = logits if logits is None else self._fit(logits)  # [T, vocab] once computed

    @property
    def screened(self) -> bool:
        return self._logits is None and isinstance(self.head, ScreenedHead) and self.head.screening

    def argmax(self) -> list[int]:
        """[T] every token's greedy choice."""
        if self.screened:
            return self.head.argmax(self.hidden)[0].tolist()
        return greedy(self.logits()).tolist()

    def logits(self, rows: slice = slice(None)) -> torch.Tensor:
        """[len(rows), vocab]: the logits of the stream's tokens ``rows``."""
        if self._logits is None:
            if rows != slice(None) and self.screened:  # a screened pass: only the sampling rows pay for the product
                return self._fit(self.head(self.hidden[rows]))
            self._logits = self._fit(self.head(self.hidden))
        return self._logits[rows]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            return _fit_vocab(logits, self.vocab_size)
        return logits


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
