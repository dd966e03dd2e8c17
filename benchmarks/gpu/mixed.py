"""Part 4 of benchmarks/gpu_check.sh: one mixed workload through iterserve and through
transformers' continuous batching (``init_continuous_batching`` manager) on the same device,
Llama-3-8B-shaped, bf16: output tokens/s, TTFT and TPOT.

Workload: ``--num-requests`` requests all sent at t=0, prompts uniform in [128, 1024] random
token ids, outputs uniform in [32, 256] tokens, ignore_eos, greedy (seeded). Each system runs
in its own process (``--system``), after a short warm-up request, so neither holds the other's
memory. Throughput = output tokens / (last finish - submit). TTFT = first token - submit;
TPOT = (last token - first token) / (tokens - 1), per request, median and p99. transformers'
per-token times come from ``record_timestamps`` where its ``add_request`` takes it.

    PYTHONPATH=. python benchmarks/gpu/mixed.py --device cuda
"""

from __future__ import annotations

import inspect
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA3_8B, TINY, Report, parser, work_dir, write_llama_checkpoint  # noqa: E402


def workload(n: int, vocab: int, tiny: bool) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    lo, hi, olo, ohi = (16, 64, 4, 16) if tiny else (128, 1024, 32, 256)
    return [
        ([rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi))
        for _ in range(n)
    ]


def summary(
    name: str, wall: float, per_req: list[tuple[float | None, float | None, int]], note: str
) -> dict[str, Any]:
    toks = sum(n for _, _, n in per_req)
    ttft = sorted(t for t, _, _ in per_req if t is not None)
    tpot = sorted(t for _, t, _ in per_req if t is not None)

    def q(xs: list[float], p: float) -> float | None:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    return {
        "system": name,
        "wall_s": wall,
        "output_tokens": toks,
        "tok_s": toks / wall,
        "ttft_p50": q(ttft, 0.5),
        "ttft_p99": q(ttft, 0.99),
        "tpot_p50": q(tpot, 0.5),
        "tpot_p99": q(tpot, 0.99),
        "finished": len(per_req),
        "note": note,
    }


def run_iterserve(path: str, wl: list[tuple[list[int], int]], device: str) -> dict[str, Any]:
    from iterserve import LLM, SamplingParams

    llm = LLM(
        path,
        dtype="bfloat16",
        device=device,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=2048,
    )
    llm.generate([wl[0][0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in wl]
    t0 = time.monotonic()  # RequestMetrics use time.monotonic
    outs = llm.generate([p for p, _ in wl], params)
    wall = time.monotonic() - t0
    per_req = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        ttft = None if m.first_token_time is None else m.first_token_time - t0
        tpot = None
        if m.first_token_time is not None and m.last_token_time is not None and n > 1:
            tpot = (m.last_token_time - m.first_token_time) / (n - 1)
        per_req.append((ttft, tpot, n))
    a = llm.engine.args
    note = (
        f"max_num_seqs {a.max_num_seqs}, max_num_batched_tokens "
        f"{a.max_num_batched_tokens}, KV pool {llm.engine.runner.num_kv_blocks} blocks, "
        f"graphs {'on' if llm.engine.runner.graphs is not None else 'off'}"
    )
    return summary("iterserve", wall, per_req, note)


def run_hf(path: str, wl: list[tuple[list[int], int]], device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(o for _, o in wl), eos_token_id=-1, pad_token_id=0
    )
    kw: dict[str, Any] = {}
    takes = inspect.signature(model.init_continuous_batching).parameters
    try:  # transformers' CB settings object, where this version has one
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if "continuous_batching_config" not in takes:
            raise ImportError("init_continuous_batching takes no continuous_batching_config")

        # The same token budget per step as iterserve's; a small cache in a CPU dry run (by
        # default transformers sizes it from free memory).
        cb = {"num_blocks": 64} if device == "cpu" else {}
        kw["continuous_batching_config"] = ContinuousBatchingConfig(max_batch_tokens=2048, **cb)
    except ImportError:
        pass
    mgr = model.init_continuous_batching(generation_config=gen, **kw)
    accepted = inspect.signature(mgr.add_request).parameters
    extra = {k: v for k, v in (("record_timestamps", True), ("eos_token_id", -1)) if k in accepted}
    mgr.start()
    try:
        mgr.add_request(wl[0][0][:16], request_id="warmup", max_new_tokens=4)
        while (r := mgr.get_result(timeout=120)) is not None and not (
            r.request_id == "warmup" and r.is_finished()
        ):
            pass
        t0 = time.perf_counter()  # GenerationOutput times are time.perf_counter
        for i, (p, o) in enumerate(wl):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, **extra)
        done: dict[str, Any] = {}
        last = t0
        while len(done) < len(wl):
            r = mgr.get_result(timeout=5)
            if r is None:
                if not mgr.is_running():
                    break
                continue
            if r.is_finished():
                done[r.request_id] = r
                last = time.perf_counter()
        wall = last - t0
    finally:
        mgr.stop(block=True)
    per_req = []
    for r in done.values():
        n = len(r.generated_tokens)
        ts = getattr(r, "timestamps", None) or []
        ttft = ts[0] - t0 if ts else None
        tpot = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None
        per_req.append((ttft, tpot, n))
    note = (
        f"attn {getattr(model.config, '_attn_implementation', '?')}; "
        f"{'max_batch_tokens 2048; ' if kw else ''}"
        + (
            "per-token times recorded"
            if "record_timestamps" in extra
            else "no TTFT/TPOT (no record_timestamps)"
        )
        + ("" if len(done) == len(wl) else f"; only {len(done)}/{len(wl)} finished")
    )
    return summary("transformers CB", wall, per_req, note)


def main() -> int:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--system", default="both", choices=["both", "iterserve", "hf"])
    p.add_argument("--result", help="(internal) where --system writes its JSON")
    ns = p.parse_args()
    shape = TINY if ns.tiny else LLAMA3_8B
    path = write_llama_checkpoint(
        f"{work_dir(ns)}/{'tiny' if ns.tiny else 'llama3-8b'}-bf16",
        shape,
        torch.bfloat16,
        ns.device,
    )
    wl = workload(8 if ns.tiny else ns.num_requests, shape["vocab_size"], ns.tiny)
    if ns.system != "both":
        res = (run_iterserve if ns.system == "iterserve" else run_hf)(path, wl, ns.device)
        Path(ns.result).write_text(json.dumps(res))
        return 0
    results = []
    for system in ("iterserve", "hf"):
        out = Path(work_dir(ns)) / f"mixed-{system}.json"
        out.unlink(missing_ok=True)
        argv = [
            sys.executable,
            __file__,
            "--system",
            system,
            "--result",
            str(out),
            "--device",
            ns.device,
            "--out",
            ns.out,
            "--num-requests",
            str(ns.num_requests),
        ]
        argv += ["--tiny"] if ns.tiny else []
        rc = subprocess.run(argv).returncode
        results.append(
            json.loads(out.read_text())
            if rc == 0 and out.exists()
            else {"system": system, "error": f"exit {rc}"}
        )
    rep = Report(ns, "mixed", "4. Mixed workload: iterserve against transformers CB")
    rep.line(
        f"{len(wl)} requests at t=0, prompts {min(len(p) for p, _ in wl)}-"
        f"{max(len(p) for p, _ in wl)} tokens, outputs {sum(o for _, o in wl)} tokens in "
        f"all, greedy, ignore_eos; {'tiny' if ns.tiny else 'Llama-3-8B'}-shaped bf16"
    )
    rep.line()

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["system"], r["error"], "", "", "", "", "", ""])
            continue
        rows.append(
            [
                r["system"],
                f"{r['tok_s']:,.0f}",
                f"{r['wall_s']:.1f}",
                ms(r["ttft_p50"]),
                ms(r["ttft_p99"]),
                ms(r["tpot_p50"]),
                ms(r["tpot_p99"]),
                r["note"],
            ]
        )
    rep.table(
        [
            "system",
            "output tok/s",
            "wall s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "settings",
        ],
        rows,
    )
    if all("tok_s" in r for r in results):
        ratio = results[0]["tok_s"] / results[1]["tok_s"]
        rep.line()
        rep.line(
            f"iterserve / transformers CB throughput: {ratio:.2f}x (target, a benchmark "
            "figure: >= 3x)"
        )
    rep.data["results"] = results
    rep.write()
    return 0 if all("tok_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
