"""Step-time cost models: what one forward pass of a scheduled batch costs.

The simulator asks a cost model one question per step: how long does this batch take? The
batch is summarised by a ``StepShape`` (token counts and attention work, from the scheduler's
own ``SchedulerOutput``), so a cost model never sees requests or the KV cache.

``RooflineCostModel`` prices every operator of a decoder layer roofline-style on a datasheet
accelerator:

    linear (qkv, o, gate/up, down, LM head)   max(FLOPs / (gemm * peak), bytes / (mem * bw))
    prefill attention                         compute-bound over chunk x context (causal)
    decode attention                          memory-bound on the KV bytes read
    elementwise (norms, RoPE, SiLU, adds)     memory-bound on activations
    tensor parallel                           two all-reduces per layer: latency + ring bytes
    CPU                                       per step + per scheduled sequence

``cpu_profile.CpuProfileCostModel`` is the same interface fitted to this machine's engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from iterserve.config import DTYPE_BYTES
from iterserve.core.request import Request
from iterserve.core.scheduler import SchedulerOutput
from iterserve.model.model_config import ModelConfig
from iterserve.sim.hardware import Hardware
from iterserve.sim.roofline import DecoderShape


@dataclass
class StepShape:
    """What a cost model needs to know about one step's batch."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0  # rows whose logits are computed (their last token is scheduled)
    num_decodes: int = 0  # single-token items
    decode_ctx_sum: int = 0  # keys the decodes attend to (context including the new token)
    decode_ctx_max: int = 0
    num_prefills: int = 0  # multi-token items (prefill chunks, recomputation)
    prefill_tokens: int = 0
    prefill_pairs: int = 0  # causal (query, key) pairs over all chunks
    prefill_ctx_sum: int = 0  # keys each chunk attends to (start + length), summed
    prefill_cached_ctx: int = 0  # keys chunks read back from the cache (start > 0), summed


def step_shape(out: SchedulerOutput, sampled: list[Request] | None = None) -> StepShape:
    """Summarise a step decision; call before ``update_from_output`` (it reads each request's
    ``num_computed_tokens`` as the chunk's start position). Requests whose last token runs in
    this step (the engine samples them) are appended to ``sampled`` when it is given."""
    s = StepShape(num_seqs=len(out.requests))
    tokens = nsampled = nd = dsum = dmax = npf = ptok = pairs = psum = pcached = 0
    for req, n in zip(out.requests, out.num_tokens):
        start = req.num_computed_tokens
        ctx = start + n
        tokens += n
        if ctx == len(req.all_token_ids):
            nsampled += 1
            if sampled is not None:
                sampled.append(req)
        if n == 1:
            nd += 1
            dsum += ctx
            if ctx > dmax:
                dmax = ctx
        else:
            npf += 1
            ptok += n
            pairs += n * start + n * (n + 1) // 2
            psum += ctx
            if start:
                pcached += start
    s.num_tokens, s.num_sampled = tokens, nsampled
    s.num_decodes, s.decode_ctx_sum, s.decode_ctx_max = nd, dsum, dmax
    s.num_prefills, s.prefill_tokens, s.prefill_pairs = npf, ptok, pairs
    s.prefill_ctx_sum, s.prefill_cached_ctx = psum, pcached
    return s


class CostModel(Protocol):
    """Seconds one engine step takes for a batch of this shape (forward, sampling, CPU)."""

    def step_time(self, shape: StepShape) -> float: ...


class RooflineCostModel:
    """Per-operator roofline of a Llama-family decoder on ``hw`` with ``tp``-way tensor
    parallelism (Megatron layout: heads and MLP columns split, two all-reduces per layer)."""

    def __init__(
        self,
        model: ModelConfig,
        hw: Hardware,
        tp: int = 1,
        dtype: str = "bfloat16",
        kv_dtype: str | None = None,
    ) -> None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        shape = DecoderShape.of(model, tp)
        self.model, self.hw, self.tp, self.shape = model, hw, tp, shape
        self.wb = DTYPE_BYTES[dtype]  # weight and activation bytes per element
        self.kvb = DTYPE_BYTES[kv_dtype or dtype]
        self.hidden, self.q_dim, self.kv_dim = shape.hidden, shape.q_dim, shape.kv_dim
        self.inter, self.vocab, self.layers = shape.inter, shape.vocab, shape.layers
        e = hw.efficiency
        self._flops_gemm = e.gemm * hw.peak_flops
        self._bw = e.mem * hw.mem_bw
        self._flops_attn = e.attn_compute * hw.peak_flops
        self._bw_attn = e.attn_mem * hw.mem_bw
        self._kernel = e.kernel_s
        self._attn_flops_per_pair = shape.attn_flops_per_key  # per layer
        self._kv_bytes_per_key = shape.kv_bytes_per_key(self.kvb)
        self._linear_cache: dict[int, float] = {}
        self._lm_head_cache: dict[int, float] = {}

    # ---- memory ------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.num_params * self.wb / self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies on each GPU (all layers, K and V)."""
        return self.shape.kv_bytes_per_token(self.kvb)

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Peak activation memory of a full step (the largest intermediates live at once:
        the gate/up output and the fp32 logits), as a profiling run would reserve."""
        per_token = (2 * self.inter + self.q_dim + 2 * self.kv_dim + 4 * self.hidden) * self.wb
        return max_num_batched_tokens * per_token + max_num_seqs * self.vocab * 4

    # ---- operators ---------------------------------------------------------------------
    def _gemm(self, tokens: int, k: int, n: int) -> float:
        flops = 2.0 * tokens * k * n
        nbytes = (k * n + tokens * (k + n)) * self.wb
        return max(flops / self._flops_gemm, nbytes / self._bw, self._kernel)

    def _allreduce(self, nbytes: float) -> float:
        """Ring all-reduce of ``nbytes`` across the tensor-parallel group (0 without TP)."""
        if self.tp == 1:
            return 0.0
        e = self.hw.efficiency
        return e.net_latency_s + 2 * (self.tp - 1) / self.tp * nbytes / (e.net * self.hw.link_bw)

    def projection_times(self, tokens: int) -> tuple[float, float, float, float]:
        """One layer's projection GEMMs for ``tokens`` tokens: qkv, o, gate + up, down."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.inter
        return (
            self._gemm(tokens, h, q + 2 * kv),
            self._gemm(tokens, q, h),
            self._gemm(tokens, h, 2 * i),
            self._gemm(tokens, i, h),
        )

    def elementwise_time(self, tokens: int) -> float:
        """One layer's elementwise ops, memory-bound: 2 RMSNorms and 2 residual adds (read +
        write h each), RoPE on q/k, SiLU*mul; at least four kernels."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.inter
        nbytes = tokens * (8 * h + 2 * (q + kv) + 3 * i) * self.wb
        return max(nbytes / self._bw, 4 * self._kernel)

    def attention_kernel_time(self, pairs: int, keys: int, queries: int) -> float:
        """One layer's attention kernel: ``pairs`` (query, key) products, ``keys`` keys read
        from the KV cache, ``queries`` query tokens read and written."""
        flops = self._attn_flops_per_pair * pairs
        nbytes = self._kv_bytes_per_key * keys + 2 * queries * self.q_dim * self.wb
        return max(flops / self._flops_attn, nbytes / self._bw_attn, self._kernel)

    def linear_time(self, tokens: int) -> float:
        """All layers' token-parallel work for ``tokens`` tokens: projections, elementwise
        ops and tensor-parallel all-reduces (cached: it depends on the token count only)."""
        t = self._linear_cache.get(tokens)
        if t is None:
            h = self.hidden
            per_layer = (
                sum(self.projection_times(tokens))
                + self.elementwise_time(tokens)
                + 2 * self._allreduce(tokens * h * self.wb)
            )
            embed = tokens * h * self.wb / self._bw
            t = self.layers * per_layer + embed
            self._linear_cache[tokens] = t
        return t

    def lm_head_time(self, rows: int) -> float:
        t = self._lm_head_cache.get(rows)
        if t is None:
            t = self._gemm(rows, self.hidden, self.vocab) if rows else 0.0
            if rows:  # gather the vocabulary shards of the logits (priced as an all-reduce)
                t += self._allreduce(rows * self.vocab * self.wb)
            self._lm_head_cache[rows] = t
        return t

    def attention_time(self, s: StepShape) -> float:
        t = 0.0
        if s.num_prefills:
            t += self.attention_kernel_time(s.prefill_pairs, s.prefill_ctx_sum, s.prefill_tokens)
        if s.num_decodes:  # one query per sequence: as many pairs as keys
            t += self.attention_kernel_time(s.decode_ctx_sum, s.decode_ctx_sum, s.num_decodes)
        return self.layers * t

    def cpu_time(self, s: StepShape) -> float:
        e = self.hw.efficiency
        return e.step_s + e.per_seq_s * s.num_seqs

    def step_time(self, s: StepShape) -> float:
        return (
            self.linear_time(s.num_tokens)
            + self.lm_head_time(s.num_sampled)
            + self.attention_time(s)
            + self.cpu_time(s)
        )

    def breakdown(self, s: StepShape) -> dict[str, float]:
        """Seconds per component of one step (for reports and tests)."""
        return {
            "linear": self.linear_time(s.num_tokens),
            "lm_head": self.lm_head_time(s.num_sampled),
            "attention": self.attention_time(s),
            "cpu": self.cpu_time(s),
        }


class ReplayCostModel:
    """Returns recorded step durations in order (to replay a real run's timing)."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.index = 0

    def step_time(self, shape: StepShape) -> float:
        if self.index >= len(self.durations):
            raise IndexError(
                f"the simulation ran more steps than the {len(self.durations)} recorded"
            )
        t = self.durations[self.index]
        self.index += 1
        return t
