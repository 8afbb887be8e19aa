"""Decode and verify passes at a fixed shape, replayed from CUDA graphs.

Why: on a GPU a decode step of a small model is kernel launches, not arithmetic: dozens of layers of a dozen kernels
each, and the Python between them, take longer than reading the weights. A CUDA graph records the kernels of one
pass once and replays them with one launch (gpt-fast's decode step, vLLM's piecewise graphs).

A graph replays exactly the shapes and addresses it recorded, so a pass must look the same every step:
- **One shape: ``rows x width`` tokens.** The step's ragged stream (row b's last token and its drafts) is placed
  into a [rows, width] grid, row b at grid row b, and the rest of the grid is padding. Every pass of a deployment's
  target then multiplies the same ``rows x width`` matrix rows: the same GEMM kernels, so a token's logits do not
  depend on how many tokens share the pass (a cuBLAS kernel is picked by shape; a pass of 1 token and one of 5 could
  take kernels that sum in different orders, and speculation would no longer match plain decoding). On a GPU that
  costs nothing while the grid is under the GEMM's ridge point: a 1.5B model's products read 3 GB of weights
  whether they multiply 1 row or 72. The price is attention over every grid row's cache (masked), which is small
  next to the weights at chat lengths.
- **Attention over the cache as it is**, not gathered: grid row b reads cache row b's keys ``[0, capacity)`` through a
  mask (a token sees its row up to its own position), with grouped heads folded into the query length as the eager
  path does (``depctl_runtime.model.attention._attend``). Padding tokens write their keys into the cache's scratch row
  (``SlotCache.reserve_scratch``), which nothing reads; padding grid rows read other rows' caches and are dropped.
- **Static inputs.** Token ids, positions, cache rows and mask limits live in device buffers the graph reads; a call
  fills them (one small host-to-device copy) and replays. The cache's tensors are replaced when it grows (capacity
  doubles), and then the graph is recorded again at the next call.

Everything but the recording is device-independent: ``capture=False`` runs the same padded pass eagerly (the CPU
tests use it). The loader checks, on the device, that a verify pass through the graph equals one-token steps through
it bit for bit (``compiled.check``) before a deployment uses it.
"""

from __future__ import annotations

import logging

import torch

from depctl_runtime.model import decoder

log = logging.getLogger("depctl.graphs")


class FixedShapePass:
    """A fused model's pass over its runner's cache at ``rows x width`` tokens (one graph per width in ``widths``,
    the narrowest that fits a call; a target keeps one width, see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        rows: int,
        widths: tuple[int, ...],
        capture: bool | None = None,
        features: tuple[int, ...] = (),
    ):
        self.model, self.cache, self.rows = model, cache, rows
        self.features = features  # layers whose outputs the pass also returns (``decoder.forward_with_features``)
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.scratch = cache.reserve_scratch()
        # width -> (graph, its logits, its layer features or None)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        # per width: [4, rows * width] ids, positions, cache rows, and the last position each token sees
        self.set_widths(widths)
        self._recorded_for = None  # the cache tensors the graphs were recorded over
        self.recordings = 0  # graphs recorded so far (a test asserts steady state records none)

    def set_widths(self, widths: tuple[int, ...]) -> None:
        """New grid widths (``deployment update --draft-token-count`` in place): recorded again at their first use."""
        self.widths = tuple(sorted(set(widths)))
        self.inputs = {w: self._padding(w) for w in self.widths}
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forget every recorded graph, and their memory pool with them: PyTorch's allocator refuses a capture into a
        pool whose graphs are all gone while it still caches their blocks, so the next recording opens a new pool."""
        self.graphs.clear()
        self._pool = None

    returns_hidden = False

    def fits(self, first: int, widths: list[int], keep: list[int] | None = None) -> bool:
        return first == 0 and len(widths) <= self.rows and max(widths) <= self.widths[-1]

    def _padding(self, width: int) -> torch.Tensor:
        """Inputs that are all padding: every token writes to the scratch row at a position of its own."""
        n = self.rows * width
        pad = torch.zeros(4, n, dtype=torch.long, device=self.device)
        pad[1] = torch.arange(n, device=self.device) % self.cache.capacity
        pad[2] = self.scratch
        return pad

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, layout, cache=None, keep: list[int] | None = None):
        """input_ids [T] (the flat stream, on the device); returns the logits [T, vocab], or of the stream indices in
        ``keep``, and the layer features [T, layers * hidden] (None without)."""
        width = next(w for w in self.widths if w >= max(layout.widths))
        n = self.rows * width
        capacity = self.cache.capacity
        # host side: the grid's positions, cache rows and mask limits, then each real token's place in the grid
        positions = [t % capacity for t in range(n)]
        rows = [self.scratch] * n
        limits = [0] * n
        slots = []
        for b, (start, w) in enumerate(zip(layout.starts, layout.widths)):
            for j in range(w):
                t = b * width + j
                positions[t] = limits[t] = start + j
                rows[t] = b
                slots.append(t)
        picks = slots if keep is None else [slots[i] for i in keep]
        host = torch.tensor(positions + rows + limits + slots + picks, dtype=torch.long)
        staged = host.to(self.device)
        inputs = self.inputs[width]
        inputs[1:].copy_(staged[: 3 * n].view(3, n))
        inputs[0].zero_()
        inputs[0].index_copy_(0, staged[3 * n : 3 * n + len(slots)], input_ids)
        picked = staged[3 * n + len(slots) :]
        logits, features = self._pass(inputs, width) if not self.capture else self._replay(width)
        real = staged[3 * n : 3 * n + len(slots)]
        return logits.index_select(0, picked), (None if features is None else features.index_select(0, real))

    def _pass(self, inputs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The recorded pass: [rows * width] tokens in, their logits [rows * width, vocab] out (and their layer
        features [rows * width, layers * hidden], or None)."""
        ids, positions, rows, limits = inputs
        layers = self.cache.layers
        capacity = layers[0].keys.shape[2]
        grid = self.rows
        groups = self.model.model.layers[0].self_attn.num_key_value_groups
        # token (b, j) sees positions up to its own of cache row b; a query's rows are (group, position) once folded
        sees = torch.arange(capacity, device=ids.device) <= limits[:, None]  # [n, capacity]
        mask = sees.view(grid, 1, 1, width, capacity).expand(grid, 1, groups, width, capacity)
        mask = mask.reshape(grid, 1, groups * width, capacity)

        def attend(i, attn, q, k, v):
            keys, values = layers[i].keys, layers[i].values
            keys[rows, :, positions] = k[0].transpose(0, 1)
            values[rows, :, positions] = v[0].transpose(0, 1)
            heads, dim = q.shape[1], q.shape[3]
            # [1, heads, n, dim] -> [grid, kv_heads, groups * width, dim]: head h = kv_head * groups + g
            folded = (
                q[0].view(heads, grid, width, dim).transpose(0, 1).reshape(grid, heads // groups, groups * width, dim)
            )
            out = torch.nn.functional.scaled_dot_product_attention(
                folded, keys[:grid], values[:grid], attn_mask=mask, scale=attn.scaling
            )
            return out.reshape(grid, heads, width, dim).transpose(1, 2).reshape(1, grid * width, heads, dim)

        return decoder.forward_with_features(self.model, ids, positions, attend, features=self.features)

    def _replay(self, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        recorded_for = tuple(layer.keys.data_ptr() for layer in self.cache.layers)
        if recorded_for != self._recorded_for:  # the cache grew: its tensors are new
            self._drop_graphs()
            self._recorded_for = recorded_for
        if width not in self.graphs:
            self.graphs[width] = self._record(width)
        graph, logits, features = self.graphs[width]
        graph.replay()
        return logits, features

    def _record(self, width: int):
        """Record the pass at ``width`` (warmed up on a side stream first, as CUDA graphs require). The warm-up runs
        really execute, so they run on all-padding inputs, which write only to the scratch row."""
        inputs = self.inputs[width]
        real = inputs.clone()
        inputs.copy_(self._padding(width))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._pass(inputs, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another deployment of the daemon may be decoding on this GPU from its own thread meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, features = self._pass(inputs, width)
        inputs.copy_(real)
        self.recordings += 1
        log.info(
            "recorded a CUDA graph of %d rows x %d tokens over %d cached positions",
            self.rows,
            width,
            self.cache.capacity,
        )
        return graph, logits, features

    def release(self) -> None:
        pass  # the graphs hold the model's weights as the model does: emptying them frees both

    def describe(self) -> str:
        shapes = ", ".join(f"{self.rows} x {w}" for w in self.widths)
        return f"CUDA graphs of {shapes} tokens" if self.capture else f"fixed-shape passes of {shapes} tokens"
