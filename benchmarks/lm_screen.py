"""Greedy decode steps with and without the LM head's int8 screen (``Kernels.gemm_screen_argmax``,
docs/SPEED.md, "The LM head's greedy argmax on an int8 screen"), in one process on one engine,
alternated.

    python benchmarks/lm_screen.py --batches 1,2,4 --rounds 9
    python benchmarks/lm_screen.py --model smollm2-135m --batches 1
    python benchmarks/lm_screen.py --kernel --batches 1,2,3,4   # the two kernels alone

B requests with 128-token random prompts decode greedily (ignore_eos) together; each round
times ``--steps`` steps with the screen, then without (the order flips every round), and
reports the median step of each round, the medians and the median of the rounds' ratios. The
tokens are the same either way (tests/test_kernels.py), so both halves of a round decode the
same requests; the context grows by one token a step. Prefix caching is off so that no
request's prefill is served from another's.

``--kernel``: the two kernels alone at the model's LM head shape (random bf16 weights, N(0,
0.05)), ``gemm_argmax`` against ``gemm_screen_argmax`` on random rows, cold: five copies of the
weight cycled (more than the caches hold), each call's weight last used four calls ago; the
median over ``--rounds`` rounds of the mean ms a call, alternated.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from iterserve import LLM, SamplingParams
from iterserve.model import kernels, layers


def ab_parser(doc: str | None, kernel_help: str) -> argparse.ArgumentParser:
    """The options of an on / off decode-step comparison (this script's, pairs12.py's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=20, help="steps a half round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", action="store_true", help=kernel_help)
    return ap


def ab_batches(ns: argparse.Namespace, max_rows: int, what: str) -> list[int]:
    """``--batches``, each from 1 to ``max_rows`` (else exits saying so)."""
    batches = [int(b) for b in ns.batches.split(",") if b]
    if any(not 1 <= b <= max_rows for b in batches):
        raise SystemExit(f"--batches: {what} at 1 to {max_rows} rows")
    return batches


def ab_llm(ns: argparse.Namespace) -> tuple[LLM, int]:
    """A bf16 engine whose requests live through all of ``ns``' rounds, and the tokens they
    need (prefix caching off: no request's prefill served from another's)."""
    steps_needed = 8 + 2 * ns.rounds * ns.steps
    llm = LLM(
        ns.model, dtype="bfloat16", num_threads=ns.threads, seed=0,
        enable_prefix_caching=False, max_model_len=128 + steps_needed + 8,
    )  # fmt: skip
    return llm, steps_needed


def main() -> None:
    ns = ab_parser(__doc__, "the two kernels alone").parse_args()
    batches = ab_batches(ns, kernels.LM_SCREEN_MAX_ROWS, "the screen runs")
    if ns.kernel:
        kernel_only(ns.model, batches, ns.rounds, ns.threads)
        return
    llm, steps_needed = ab_llm(ns)
    lm_head = llm.engine.runner.model.lm_head
    heads = {id(f): f for f in (layers.for_rows(lm_head, r) for r in batches)}.values()
    screen = getattr(next(iter(heads)), "screen", None)
    if screen is None or any(getattr(f, "screen", None) is not screen for f in heads):
        raise SystemExit("no LM head screen on this machine / model (kernels.has_lm_screen)")
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=steps_needed, temperature=0, ignore_eos=True)

    def use(on: bool) -> None:
        for f in heads:
            f.screen = screen if on else None

    for b in batches:
        times = alternated_decode_steps(llm, b, ns.rounds, ns.steps, use, sp, rng)
        report(f"{ns.model} B={b}", ("screen", "without"), times)


def alternated_decode_steps(
    llm: LLM,
    b: int,
    rounds: int,
    steps: int,
    use: Callable[[bool], None],
    sp: SamplingParams,
    rng: random.Random,
) -> dict[bool, list[float]]:
    """``b`` requests with 128-token random prompts decoding together under ``sp``; each round
    times ``steps`` steps after ``use(True)``, then after ``use(False)`` (the order flips every
    round). The rounds' median step times in seconds, per setting; ``use(True)`` last, and the
    requests aborted."""
    eng = llm.engine
    ids = [f"b{b}-{i}" for i in range(b)]
    for rid in ids:
        eng.add_request(rid, [rng.randrange(5, eng.vocab_size) for _ in range(128)], sp)
    for _ in range(8):  # prefills, then a few decode steps
        eng.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            use(on)
            ts = []
            for _ in range(steps):
                t = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t)
            times[on].append(statistics.median(ts))
    use(True)
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return times


def alternated_ms(rounds: int, run: Callable[[bool], None]) -> tuple[float, float]:
    """The median ms of ``run(True)`` and of ``run(False)`` over ``rounds`` rounds, the two
    alternated (the order flips every round)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            t = time.perf_counter()
            run(on)
            times[on].append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[True]), statistics.median(times[False])


def report(label: str, names: tuple[str, str], times: dict[bool, list[float]]) -> None:
    """One line: each setting's median step and the median of the rounds' ratios."""
    ratios = [a / b for a, b in zip(times[True], times[False])]
    print(
        f"{label}: {names[0]} {statistics.median(times[True]) * 1e3:.3f} ms, {names[1]} "
        f"{statistics.median(times[False]) * 1e3:.3f} ms a step; median ratio "
        f"{statistics.median(ratios):.3f} (rounds: {' '.join(f'{x:.3f}' for x in ratios)})"
    )


def kernel_only(model: str, batches: list[int], rounds: int, threads: int) -> None:
    import torch

    from iterserve.model.builtin import resolve_model
    from iterserve.model.model_config import ModelConfig

    torch.set_num_threads(threads)
    kern = kernels.load()
    if kern is None or not kern.has_lm_screen:
        raise SystemExit("no LM head screen on this machine (kernels.has_lm_screen)")
    cfg = ModelConfig.from_pretrained(resolve_model(model))
    N, K = cfg.vocab_size, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    copies = []
    for _ in range(5):
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        screen = kern.pack_lm_screen(w)
        assert screen is not None
        copies.append((kern.pack_pairs(w), screen))
    print(f"{model} LM head {N} x {K}: ms a call, cold (5 copies cycled), median of {rounds}")
    for b in batches:
        x = torch.randn(b, K + K % 2, generator=g).bfloat16()

        def run(on: bool, x: torch.Tensor = x) -> None:
            for pairs, screen in copies:
                if on:
                    kern.gemm_screen_argmax(x, pairs, screen)
                else:
                    kern.gemm_argmax(x, pairs, N)

        screened, full = (ms / len(copies) for ms in alternated_ms(rounds, run))
        print(
            f"  {b} row(s): gemm_argmax {full:.3f}, gemm_screen_argmax {screened:.3f} "
            f"({screened / full:.2f}x)"
        )


if __name__ == "__main__":
    main()
