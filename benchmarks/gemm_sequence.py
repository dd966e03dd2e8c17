"""The kernel choice's GEMM timings against the GEMMs as a step runs them (docs/SPEED.md, "The
kernel choice at 2,048 rows").

    python benchmarks/gemm_sequence.py --rows 2048
    python benchmarks/gemm_sequence.py --prefill 2048 --settings measure,gemm=amx,gemm=onednn

``--rows R``: bench-134m's four layer GEMMs (qkv, o, gate_up with its SwiGLU as
``layers.GateUpAct`` runs it, down) at R rows on each GEMM path ``autotune.gemm_builders``
offers among torch, amx and onednn. First each alone, as ``autotune.measure_gemms`` times it
("hot": one weight, called again and again) and with 12 weights cycled ("cold": each call's
weight last used 11 calls ago, as a step's layers find theirs); medians of 7 and 5 calls, ms.
Then 12 layers' GEMMs back to back, every weight its own: all on onednn, then one kind at a
time moved to each other path, and all on amx; medians of 5, ms, ``--rounds`` rounds.

``--prefill N --settings A,B,...``: one engine (``LLM("bench-134m", dtype="bfloat16")``,
max_num_batched_tokens N) per ``ITERSERVE_KERNELS`` setting (``measure``: the measured choice),
in one process; ``--rounds`` rounds of a fresh random N-token prompt (one output token) on each
in turn, the order reversed every other round (``kernel_ab.alternated_prefills``); the median ms
of each.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve import LLM
from iterserve.model import autotune, kernels
from iterserve.model.layers import GateUpAct, choose_act

sys.path.insert(0, str(Path(__file__).parent))

from kernel_ab import alternated_prefills  # noqa: E402
from kernels import _median_ms  # noqa: E402  (benchmarks/kernels.py)

SHAPES = {"qkv": (2304, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048)}
LAYERS = 12


def gemms(rows: int, rounds: int) -> None:
    torch.manual_seed(0)
    kern = kernels.load()
    builders = autotune.gemm_builders(torch.bfloat16, kern, pack=False)
    paths = [p for p in ("torch", "amx", "onednn") if p in builders]
    act = choose_act(kern, SHAPES["gate_up"][0] // 2)
    fns = {
        kind: {
            p: [
                builders[p](torch.randn(n, k).mul(0.02).to(torch.bfloat16), None)
                for _ in range(LAYERS)
            ]
            for p in paths
        }
        for kind, (n, k) in SHAPES.items()
    }
    xs = {k: torch.randn(rows, SHAPES[k][1]).to(torch.bfloat16) for k in SHAPES}

    def call(kind: str, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return GateUpAct(f, act)(xs[kind]) if kind == "gate_up" else f(xs[kind])

    def cycle(kind: str, fs: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
        for f in fs:
            call(kind, f)

    print(f"{rows} rows, ms a call: hot (one weight) / cold ({LAYERS} weights cycled)")
    for kind in SHAPES:
        cells = []
        for p in paths:
            fs = fns[kind][p]
            hot = _median_ms(functools.partial(call, kind, fs[0]), 7)
            cold = _median_ms(functools.partial(cycle, kind, fs), 5) / LAYERS
            cells.append(f"{p} {hot:.3f} / {cold:.3f}")
        print(f"  {kind:8s} " + " | ".join(cells))

    def step(assign: dict[str, str]) -> None:
        for i in range(LAYERS):
            fns["qkv"][assign["qkv"]][i](xs["qkv"])
            fns["o"][assign["o"]][i](xs["o"])
            a = GateUpAct(fns["gate_up"][assign["gate_up"]][i], act)(xs["gate_up"])
            fns["down"][assign["down"]][i](a)

    base = dict.fromkeys(SHAPES, "onednn" if "onednn" in paths else paths[0])
    combos = [base] + [
        {**base, kind: p} for kind in SHAPES for p in paths if p != base[kind]
    ]  # fmt: skip
    if "amx" in paths:
        combos.append(dict.fromkeys(SHAPES, "amx"))
    got: dict[str, list[float]] = {}
    for _ in range(rounds):
        for c in combos:
            name = ", ".join(f"{k} {c[k]}" for k in SHAPES)
            got.setdefault(name, []).append(_median_ms(functools.partial(step, c), 5))
    print(f"{LAYERS} layers' GEMMs in sequence at {rows} rows, ms ({rounds} rounds):")
    for name, ts in got.items():
        print(f"  {name:55s} " + " ".join(f"{t:.1f}" for t in ts))


def prefill(tokens: int, settings: list[str], rounds: int) -> None:
    llms = []
    for s in settings:
        os.environ["ITERSERVE_KERNELS"] = "1" if s == "measure" else s
        llms.append(
            LLM(
                "bench-134m", dtype="bfloat16", max_num_seqs=4, seed=0,
                max_num_batched_tokens=tokens, max_model_len=max(2048, tokens + 16),
                enable_prefix_caching=False,
            )
        )  # fmt: skip
    os.environ.pop("ITERSERVE_KERNELS", None)
    times = alternated_prefills(dict(zip(settings, llms, strict=True)), tokens, rounds)
    for s, ts in times.items():
        runs = " ".join(f"{t:.0f}" for t in ts)
        print(f"prefill {tokens} tokens, {s}: median {statistics.median(ts):.1f} ms ({runs})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, help="time the layer GEMMs at this many rows")
    ap.add_argument("--prefill", type=int, help="time engine prefills of this many tokens")
    ap.add_argument("--settings", default="measure,gemm=onednn", help="ITERSERVE_KERNELS values")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.rows is None and a.prefill is None:
        ap.error("give --rows R, --prefill N, or both")
    if a.rows is not None:
        gemms(a.rows, a.rounds)
    if a.prefill is not None:
        prefill(a.prefill, a.settings.split(","), max(a.rounds, 2))


if __name__ == "__main__":
    main()
