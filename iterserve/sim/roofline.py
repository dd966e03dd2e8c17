"""The one roofline model: a decoder's per-GPU shape (read from ``ModelConfig``), a measured
machine, and lower bounds on the time of a step or a whole workload.

``RooflineCostModel`` (``cost_model.py``) prices each operator of a step from ``DecoderShape``;
the benchmark scripts print the coarser bounds below beside what the engine measures:

    decode step of B tokens at context c   max(bytes / bandwidth, FLOPs / peak), where
        bytes = matmul weights + B * c * KV bytes per token
        FLOPs = B * (2 * matmul params + attention FLOPs at c)
    prefill of T tokens                    max(matmul + attention FLOPs / peak, weights / bw)
    workload, all requests at once         max(compute, memory) summed over the requests

``measure_machine()`` probes this machine: memory-read bandwidth (``torch.sum`` over a buffer
far larger than the caches) and bf16 / fp32 matmul FLOP/s (square ``torch.matmul``), best of
several repeats. Best-of (not median) because a probe estimates what the hardware can do: a
noisy neighbour on shared cores only ever makes a probe slower.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from iterserve.core.kv_cache_manager import cdiv
from iterserve.model.model_config import ModelConfig


@dataclass(frozen=True)
class DecoderShape:
    """Matrix sizes of a Llama-family decoder on one GPU of a ``tp``-way tensor-parallel group
    (Megatron layout: heads, MLP columns and the vocabulary split across ranks)."""

    hidden: int
    q_dim: int
    kv_dim: int
    inter: int
    vocab: int
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, model: ModelConfig, tp: int = 1) -> DecoderShape:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if model.num_heads % tp:
            raise ValueError(
                f"tp={tp} must divide the number of attention heads ({model.num_heads})"
            )
        hd = model.head_dim
        # KV heads are split across ranks; with more ranks than KV heads each rank keeps one.
        kv_heads = max(1, model.num_kv_heads // tp)
        return cls(
            hidden=model.hidden_size,
            q_dim=model.num_heads * hd // tp,
            kv_dim=kv_heads * hd,
            inter=model.intermediate_size // tp,
            vocab=cdiv(model.vocab_size, tp),
            layers=model.num_layers,
            heads=model.num_heads // tp,
            head_dim=hd,
        )

    @property
    def layer_params(self) -> int:
        """Matmul weights of the transformer blocks (norm vectors are negligible, ignored)."""
        h = self.hidden
        return self.layers * (2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.inter)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """'Non-embedding' parameters: every weight a token is multiplied by (blocks + head)."""
        return self.layer_params + self.head_params

    @property
    def attn_flops_per_key(self) -> int:
        """FLOPs of one query token against one key in one layer: QK^T and PV, 2 each per
        (head, dim)."""
        return 4 * self.heads * self.head_dim

    def kv_bytes_per_key(self, dtype_bytes: int) -> int:
        """KV-cache bytes of one token in one layer (K and V)."""
        return 2 * self.kv_dim * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies (all layers, K and V)."""
        return self.layers * self.kv_bytes_per_key(dtype_bytes)

    def attn_flops(self, ctx: float) -> float:
        """FLOPs of QK^T and PV over all layers for one query token attending to ``ctx`` keys."""
        return float(self.layers * self.attn_flops_per_key) * ctx


# ---- a measured machine and the bounds --------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    threads: int
    read_gbps: float  # GB/s (1e9 bytes/s)
    bf16_gflops: float
    fp32_gflops: float

    def describe(self) -> str:
        return (
            f"{self.threads} threads: read {self.read_gbps:.1f} GB/s, "
            f"bf16 matmul {self.bf16_gflops:.0f} GFLOP/s, "
            f"fp32 matmul {self.fp32_gflops:.0f} GFLOP/s"
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @property
    def peak_gflops(self) -> float:
        """The attainable matmul peak for bf16 weights: on a CPU without native bf16 dot
        products oneDNN emulates bf16 GEMMs far below fp32, and iterserve then runs fp32
        GEMMs, so the bounds use the faster of the two."""
        return max(self.bf16_gflops, self.fp32_gflops)


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (page faults, oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Read bandwidth in GB/s: sum of a ``nbytes`` fp32 buffer (the output is one scalar), on
    2 MiB pages where Linux has them, as the engine's KV cache and packed weights are."""
    import torch

    from iterserve.model.cpu import empty_hugepages

    x = empty_hugepages((nbytes // 4,), torch.float32).fill_(1.0)
    return nbytes / _best(lambda: x.sum(), repeats) / 1e9


def measure_matmul(dtype: Any, n: int = 2048, repeats: int = 7) -> float:
    """GFLOP/s of an n x n x n matmul in torch dtype ``dtype``. A 512-cube probe first: where
    the dtype is emulated far below the machine's speed (bf16 on AVX2 CPUs runs ~1 GFLOP/s),
    that figure is kept rather than spending minutes on the full size."""
    import torch

    def run(size: int, reps: int) -> float:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        return 2 * size**3 / _best(lambda: torch.matmul(a, b), reps) / 1e9

    small = min(n, 512)
    probe = run(small, 1)
    if small == n or 2 * n**3 / (probe * 1e9) * (repeats + 1) > 20.0:
        return probe
    return run(n, repeats)


def measure_machine(threads: int | None = None, quick: bool = False) -> Machine:
    """Probes on the threads torch is set to use (``threads``: set them first)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    r = 3 if quick else 7
    return Machine(
        threads=torch.get_num_threads(),
        read_gbps=measure_bandwidth(repeats=r),
        bf16_gflops=measure_matmul(torch.bfloat16, repeats=r),
        fp32_gflops=measure_matmul(torch.float32, n=1024 if quick else 2048, repeats=r),
    )


def add_machine_arg(parser: argparse.ArgumentParser) -> None:
    """``--machine GBPS,GFLOPS`` (see ``machine_for``) for scripts that print bounds."""
    parser.add_argument(
        "--machine",
        metavar="GBPS,GFLOPS",
        help="use these read GB/s and peak GFLOP/s for the bound instead of probing (e.g. numbers "
        "probed on a quiet machine: probes on a busy one inflate the bound)",
    )


def machine_for(spec: str | None, threads: int) -> Machine:
    """``"GBPS,GFLOPS"`` -> a Machine with those numbers (bf16 = fp32 = GFLOPS); None -> probe."""
    if not spec:
        return measure_machine(threads)
    try:
        gbps, gflops = (float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(
            f"--machine takes read GB/s and peak GFLOP/s as GBPS,GFLOPS (e.g. 12.5,180), "
            f"got {spec!r}"
        ) from None
    return Machine(threads, gbps, gflops, gflops)


def decode_step_bound(
    m: Machine, s: DecoderShape, batch: int, ctx: int, dtype_bytes: int = 2
) -> tuple[float, float, float]:
    """(bound_s, memory_s, compute_s) of one decode step of ``batch`` tokens, each at ``ctx``:
    every matmul weight is read once, each sequence's KV cache once."""
    nbytes = s.matmul_params * dtype_bytes + batch * ctx * s.kv_bytes_per_token(dtype_bytes)
    mem = nbytes / (m.read_gbps * 1e9)
    comp = batch * (2.0 * s.matmul_params + s.attn_flops(ctx)) / (m.peak_gflops * 1e9)
    return max(mem, comp), mem, comp


def prefill_bound(
    m: Machine, s: DecoderShape, tokens: int, dtype_bytes: int = 2
) -> tuple[float, float, float]:
    """(bound_s, matmul_s, attention_s) of one prompt of ``tokens`` (causal: mean context
    tokens/2; the LM head only on the last token)."""
    flops_s = m.peak_gflops * 1e9
    mm = (2.0 * s.layer_params * tokens + 2.0 * s.head_params) / flops_s
    attn = tokens * s.attn_flops((tokens + 1) / 2) / flops_s
    mem = s.matmul_params * dtype_bytes / (m.read_gbps * 1e9)
    return max(mm + attn, mem), mm, attn


def _request_work(s: DecoderShape, reqs: list[tuple[int, int]]) -> tuple[float, int]:
    """FLOPs of serving ``reqs`` = [(prompt_len, output_len)] (every token through the blocks,
    the LM head once per output token, each token's attention to the keys before it), and the
    keys its decode steps read: step i = 1 .. o - 1 of a request attends to p + i keys."""
    flops = 0.0
    for p, o in reqs:
        n = p + o
        flops += 2.0 * s.layer_params * n + 2.0 * s.head_params * o
        flops += s.attn_flops(1) * n * (n + 1) / 2  # token i attends to i keys
    keys_read = sum((o - 1) * p + o * (o - 1) // 2 for p, o in reqs if o > 1)
    return flops, keys_read


def workload_bound(
    m: Machine, s: DecoderShape, reqs: list[tuple[int, int]], dtype_bytes: int = 2
) -> dict[str, float]:
    """Lower bound on the wall time of serving ``reqs`` = [(prompt_len, output_len)] at once.

    - compute: every prompt and output token goes through the blocks (2 x layer params
      FLOPs); the LM head runs once per output token; attention FLOPs at each token's context.
    - memory: a decode step reads all weights at least once and there are at least
      max(output) steps; every output token after a request's first comes from a decode step
      whose attention reads the K and V of its whole context (prompt + the tokens before it),
      which no other request shares; plus every KV byte written.

    bound = max(compute, memory), the usual roofline at workload scale (it assumes perfect
    overlap and batching, so no real system reaches it).
    """
    flops, keys_read = _request_work(s, reqs)
    compute = flops / (m.peak_gflops * 1e9)
    steps = max(o for _, o in reqs)
    kv_bytes = (sum(p + o for p, o in reqs) + keys_read) * s.kv_bytes_per_token(dtype_bytes)
    memory = (steps * s.matmul_params * dtype_bytes + kv_bytes) / (m.read_gbps * 1e9)
    out_tokens = sum(o for _, o in reqs)
    bound = max(compute, memory)
    return {
        "bound_s": bound,
        "compute_s": compute,
        "memory_s": memory,
        "output_tokens": out_tokens,
        "bound_output_tok_s": out_tokens / bound,
    }


def rate_bound(
    m: Machine, s: DecoderShape, reqs: list[tuple[int, int]], dtype_bytes: int = 2
) -> dict[str, float]:
    """Upper bounds on the request rate a server sustains on requests like ``reqs`` =
    [(prompt_len, output_len)] (their mean cost), from two costs per request that batching
    cannot share: its arithmetic (as ``workload_bound`` counts it) at the peak, and the K and
    V its decode steps read at the read bandwidth (each step reads its request's whole
    context). A rate r needs r x each cost <= 1 s: ``overlapped_rps`` = 1 / max(the two).
    A step runs the GEMMs and decode attention one after the other, so ``serial_rps`` = 1 /
    their sum is the nearer bound; both leave out the weights a step reads and every
    overhead, so no server reaches them."""
    flops, keys_read = _request_work(s, reqs)
    n = len(reqs)
    compute = flops / n / (m.peak_gflops * 1e9)
    kv_read = keys_read * s.kv_bytes_per_token(dtype_bytes) / n / (m.read_gbps * 1e9)
    return {
        "compute_s": compute,
        "kv_read_s": kv_read,
        "overlapped_rps": 1.0 / max(compute, kv_read),
        "serial_rps": 1.0 / (compute + kv_read),
    }
