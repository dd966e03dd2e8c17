"""Machine probes and roofline arithmetic shared by ``compare.py`` and ``roofline.py``.

- ``measure_machine()``: memory-read bandwidth (``torch.sum`` over a buffer far larger than the
  caches) and bf16 / fp32 matmul FLOP/s (square ``torch.matmul``), best of several repeats, on the
  threads torch is set to use. Best-of (not median) because the probes estimate what the hardware
  can do; the 2 cores are shared, so a noisy neighbour only ever makes a probe slower.
- ``ModelShape``: parameter counts / weight bytes / FLOPs of a Llama-shaped checkpoint from its
  ``config.json``.
- ``decode_step_bound`` / ``prefill_bound`` / ``workload_bound``: lower bounds on time from those.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Machine:
    threads: int
    read_gbps: float  # GB/s (1e9 bytes/s)
    bf16_gflops: float
    fp32_gflops: float

    def describe(self) -> str:
        return (
            f"{self.threads} threads: read {self.read_gbps:.1f} GB/s, bf16 matmul {self.bf16_gflops:.0f} GFLOP/s, "
            f"fp32 matmul {self.fp32_gflops:.0f} GFLOP/s"
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _best(fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()  # warm-up (page faults, oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Read bandwidth in GB/s: sum of a ``nbytes`` fp32 buffer (reduction output is one scalar)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = _best(lambda: x.sum(), repeats)
    return nbytes / t / 1e9


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 7) -> float:
    """GFLOP/s of an n x n x n matmul in ``dtype``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    t = _best(lambda: torch.matmul(a, b), repeats)
    return 2 * n**3 / t / 1e9


def measure_machine(threads: int | None = None, quick: bool = False) -> Machine:
    if threads:
        torch.set_num_threads(threads)
    r = 3 if quick else 7
    return Machine(
        threads=torch.get_num_threads(),
        read_gbps=measure_bandwidth(repeats=r),
        bf16_gflops=measure_matmul(torch.bfloat16, repeats=r),
        fp32_gflops=measure_matmul(torch.float32, n=1024 if quick else 2048, repeats=r),
    )


def machine_for(spec: str | None, threads: int) -> Machine:
    """``"GBPS,GFLOPS"`` -> a Machine with those numbers (bf16 = fp32 = GFLOPS); None -> probe."""
    if not spec:
        return measure_machine(threads)
    gbps, gflops = (float(x) for x in spec.split(","))
    return Machine(threads, gbps, gflops, gflops)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    bytes_per_param: int = 2

    @classmethod
    def from_config(cls, model_dir: str, bytes_per_param: int = 2) -> ModelShape:
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        heads = int(c["num_attention_heads"])
        return cls(
            hidden=int(c["hidden_size"]),
            intermediate=int(c["intermediate_size"]),
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            vocab=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            bytes_per_param=bytes_per_param,
        )

    @property
    def layer_params(self) -> int:
        """Matmul weights of the transformer blocks (norm vectors are negligible and ignored)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """'Non-embedding' parameters: every weight a token is multiplied by (blocks + lm_head)."""
        return self.layer_params + self.head_params

    @property
    def step_weight_bytes(self) -> int:
        """Bytes a forward step must read at least once: all matmul weights (the embedding table is
        only gathered row by row)."""
        return self.matmul_params * self.bytes_per_param

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def attn_flops(self, ctx: float) -> float:
        """FLOPs of QK^T and PV for one query token attending to ``ctx`` keys."""
        return 4.0 * self.layers * self.heads * self.head_dim * ctx


def decode_step_bound(
    m: Machine, s: ModelShape, batch: int, ctx: int
) -> tuple[float, float, float]:
    """(bound_s, memory_s, compute_s) of one decode step of ``batch`` tokens, each at ``ctx``."""
    mem = (s.step_weight_bytes + batch * ctx * s.kv_bytes_per_token()) / (m.read_gbps * 1e9)
    comp = batch * (2.0 * s.matmul_params + s.attn_flops(ctx)) / (m.bf16_gflops * 1e9)
    return max(mem, comp), mem, comp


def prefill_bound(m: Machine, s: ModelShape, tokens: int) -> tuple[float, float, float]:
    """(bound_s, matmul_s, attention_s) of one prompt of ``tokens`` (causal: mean context
    tokens/2; lm_head only on the last token)."""
    mm = (2.0 * s.layer_params * tokens + 2.0 * s.head_params) / (m.bf16_gflops * 1e9)
    attn = tokens * s.attn_flops((tokens + 1) / 2) / (m.bf16_gflops * 1e9)
    mem = s.step_weight_bytes / (m.read_gbps * 1e9)
    return max(mm + attn, mem), mm, attn


def workload_bound(m: Machine, s: ModelShape, reqs: list[tuple[int, int]]) -> dict[str, float]:
    """Lower bound on the wall time of serving ``reqs`` = [(prompt_len, output_len)] all at once.

    - compute: every prompt and output token goes through the blocks (2 x layer params FLOPs);
      lm_head runs once per output token; attention FLOPs at each token's context.
    - memory: a decode step reads all weights at least once and there are at least max(output)
      - 1 steps after the one that ends the longest prompt's prefill; plus every KV byte written.
    bound = max(compute, memory), the usual roofline at workload scale (it assumes perfect overlap
    and batching, so no real system reaches it).
    """
    flops = 0.0
    for p, o in reqs:
        n = p + o
        flops += 2.0 * s.layer_params * n + 2.0 * s.head_params * o
        flops += s.attn_flops(1) * n * (n + 1) / 2  # token i attends to i keys
    compute = flops / (m.bf16_gflops * 1e9)
    steps = max(o for _, o in reqs)
    mem_bytes = steps * s.step_weight_bytes + sum(p + o for p, o in reqs) * s.kv_bytes_per_token()
    memory = mem_bytes / (m.read_gbps * 1e9)
    out_tokens = sum(o for _, o in reqs)
    bound = max(compute, memory)
    return {
        "bound_s": bound,
        "compute_s": compute,
        "memory_s": memory,
        "output_tokens": out_tokens,
        "bound_output_tok_s": out_tokens / bound,
    }


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        description="probe this machine's read bandwidth and matmul FLOP/s"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--repeats", type=int, default=3, help="independent probe runs (median printed)"
    )
    ns = ap.parse_args()
    runs = [measure_machine(ns.threads) for _ in range(ns.repeats)]
    for r in runs:
        print(r.describe())
