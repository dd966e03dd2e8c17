"""CUDA graphs for decode-only steps: one graph per captured batch size, replayed on inputs
padded to the next captured size.

A graph replays fixed kernels on fixed addresses, so every input of the captured decode
forward lives in ONE static int32 device buffer (token ids, positions, slot mapping, sequence
lengths, block tables), refilled in place each step from a pinned host mirror with one
``copy_`` (non_blocking). The captured forward reads only that buffer, and the launchers it
calls take their grids from shapes alone (triton_attention.choose_num_splits), so a replay
needs no host-device sync and allocates nothing outside the graph's pool.

Padding rows (batch ``n`` run at captured size ``b > n``): token 0 at position 0, slot -1 (the
KV-write kernel skips it, so no cache row changes), sequence length 1 over whatever block id
the row's table holds (any valid id: its one key is read and the row's output dropped).

Capture and replay need CUDA; ``DecodeGraphs(..., capture=False)`` runs the same buffers,
padding and slicing with the forward called eagerly at the padded size instead of replayed,
which is how CPU tests prove padded outputs equal unpadded ones.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs``, and ``max_num_seqs``
    itself, so every decode batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 8)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest captured size >= n (None: n is larger than every size)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphInputs:
    """Views of the static buffer for batch size ``b`` (all int32, on the device)."""

    input_ids: torch.Tensor  # [b]
    positions: torch.Tensor  # [b]
    slot_mapping: torch.Tensor  # [b]; -1 on padding rows
    seq_lens: torch.Tensor  # [b]; 1 on padding rows
    block_tables: torch.Tensor  # [b, max_blocks]
    query_start_loc: torch.Tensor  # [b + 1]: 0, 1, ..., b (one token per row)
    logit_rows: torch.Tensor  # [b]: 0 .. b - 1


# The captured forward: the step's inputs -> float32 logits [b, vocab].
GraphForward = Callable[[GraphInputs], torch.Tensor]

_FIELDS = 4  # input_ids, positions, slot_mapping, seq_lens: one row each per batch slot


class DecodeGraphs:
    """Static buffers, the graphs over them, and ``run`` (pad, copy once, replay, slice)."""

    def __init__(
        self,
        forward: GraphForward,
        sizes: Sequence[int],
        max_blocks: int,
        device: torch.device,
        *,
        capture: bool = True,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be increasing positive batch sizes, got {sizes}")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.sizes = list(sizes)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.device = device
        self.capture_graphs = capture
        n = self.max_batch
        numel = _FIELDS * n + n * max_blocks
        self.static = torch.zeros(numel, dtype=torch.int32, device=device)
        # Pinned only where there is a device to copy to (pinning needs CUDA).
        self.host = torch.zeros(numel, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._host_np = self.host.numpy()
        # recorded after each step's copy of ``host``: the next step waits for it before
        # rewriting ``host`` (a step that samples nothing, such as one of 1-token prefill
        # chunks, has no sync after it, and its queued copy would read the next step's rows)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._arange = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def inputs(self, b: int) -> GraphInputs:
        n, s = self.max_batch, self.static
        return GraphInputs(
            input_ids=s[0:b],
            positions=s[n : n + b],
            slot_mapping=s[2 * n : 2 * n + b],
            seq_lens=s[3 * n : 3 * n + b],
            block_tables=s[4 * n :].view(n, self.max_blocks)[:b],
            query_start_loc=self._arange[: b + 1],
            logit_rows=self._arange[:b],
        )

    def capture(self) -> None:
        """Captures one graph per size, largest first so the smaller ones reuse its pool (as
        vLLM does). The static buffer holds padding values, so captures write no KV."""
        if not self.capture_graphs:
            return
        self._fill([], [], [], [], 0)
        self.static.copy_(self.host)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                inputs = self.inputs(b)
                self.forward(inputs)  # warm-up: Triton compiles, cuBLAS picks its kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self.forward(inputs)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def can_run(self, num_rows: int, max_blocks_needed: int) -> bool:
        return num_rows <= self.max_batch and max_blocks_needed <= self.max_blocks

    def _fill(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        b: int,
    ) -> None:
        """The host mirror for a batch of len(input_ids) rows padded to ``b`` (0: all rows)."""
        n, h = self.max_batch, self._host_np
        rows = len(input_ids)
        b = b or n
        h[0:rows] = input_ids
        h[n : n + rows] = positions
        h[2 * n : 2 * n + rows] = slots
        h[3 * n : 3 * n + rows] = np.asarray(positions, dtype=np.int32) + 1
        h[rows:b] = 0
        h[n + rows : n + b] = 0
        h[2 * n + rows : 2 * n + b] = -1
        h[3 * n + rows : 3 * n + b] = 1
        tables = h[4 * n :].reshape(n, self.max_blocks)
        for r, bt in enumerate(block_tables):
            tables[r, : len(bt)] = bt
        # Padding rows keep their old block ids (valid ids, or 0 from the start).

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One decode step of len(input_ids) sequences; ``block_tables[i]`` covers position
        ``positions[i]``. Returns float32 logits [rows, vocab] (a view of the graph's output
        buffer, valid until the next ``run``)."""
        rows = len(input_ids)
        b = padded_size(self.sizes, rows)
        if b is None or rows == 0:
            raise ValueError(f"no captured size for {rows} decodes (max {self.max_batch})")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host mirror
        self._fill(input_ids, positions, slots, block_tables, b)
        # One host-to-device copy per step.
        self.static.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.capture_graphs:
            self.graphs[b].replay()
            return self.outputs[b][:rows]
        return self.forward(self.inputs(b))[:rows]
