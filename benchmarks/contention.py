"""Engine throughput with and without busy-loop processes beside it (issue 18, "Contention").

    python benchmarks/contention.py                       # bench-134m bf16, policies x threads
    python benchmarks/contention.py --busy 1 --threads 1,2,auto --policies PASSIVE,unset \
        --repeats 3 --num-requests 32 --output-len 64

For each (OMP_WAIT_POLICY, thread count) one child process loads the engine once (libgomp
reads OMP_WAIT_POLICY when torch is imported, so the policy needs its own process), warms up,
then runs the same decode-heavy workload ``--repeats`` times in each condition, alternating
quiet and contended (``--busy`` processes spinning ``while True`` for the run only, each
bounded by ``--busy-max-s`` and killed when the run ends), each run after ``--settle-s`` idle:
the engine's thread governor (``iterserve.model.cpu.ThreadGovernor``) judges the cores other
processes took over windows of 0.5 s of stepping, so without the pause a quiet run right after
a contended one spent its first window or two on the threads the busy process had left it
(quiet runs of 1,579 tok/s at 2 threads, then 1,217 and 1,215 at 1; docs/SPEED.md, "How far the
targets are from the machine"). The machine may already be busy:
quiet means "no busy loops of ours", so read the ratio (contended / quiet, medians of runs
taken side by side), not the absolute figures. ``auto``: the engine's own thread choice
(``iterserve.model.cpu.default_threads``, no ``num_threads``). Policies: PASSIVE / ACTIVE set
in the environment; ``libgomp``: none set and torch imported before iterserve (libgomp's own
default, what a program that imports torch first gets); ``engine``: none set and iterserve
imported first (iterserve's default, see ``iterserve/__init__.py``). A policy may end in
``:spin=N`` to also set ``GOMP_SPINCOUNT=N`` (how many times libgomp spins at a barrier before
it sleeps; libgomp reads it when torch loads), e.g. ``engine:spin=20000``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

BUSY = (
    "import time, sys\nend = time.monotonic() + float(sys.argv[1])\n"
    "while time.monotonic() < end: pass\n"
)


def start_busy(n: int, max_s: float) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY, str(max_s)]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def child(ns: argparse.Namespace) -> None:
    """One engine, quiet and contended runs alternated; prints one JSON line."""
    # torch first: iterserve's OMP_WAIT_POLICY default comes too late
    if ns.policy.split(":")[0] == "libgomp":
        importlib.import_module("torch")
    importlib.import_module("iterserve")  # else first, so its OpenMP default applies
    import torch

    from iterserve.bench.offline import reset_prefix_cache
    from iterserve.engine.llm import LLM
    from iterserve.sampling_params import SamplingParams

    threads = None if ns.threads == "auto" else int(ns.threads)
    policy = os.environ.get("OMP_WAIT_POLICY")  # the engine takes its own default out at start
    spin = os.environ.get("GOMP_SPINCOUNT")
    llm = LLM(ns.model, dtype=ns.dtype, num_threads=threads, seed=0, max_model_len=1024)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.vocab_size
    prompts = [
        torch.randint(0, vocab, (ns.prompt_len,), generator=g).tolist()
        for _ in range(ns.num_requests)
    ]
    params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    runs: dict[str, list[float]] = {"quiet": [], "contended": []}
    used: dict[str, int] = {}  # torch's threads at the end of each condition's last run
    for _ in range(ns.repeats):
        for cond in ("quiet", "contended"):
            reset_prefix_cache(llm.engine)  # every run computes its prompts
            time.sleep(ns.settle_s)
            busy = start_busy(ns.busy if cond == "contended" else 0, ns.busy_max_s)
            try:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - t0
            finally:
                stop_busy(busy)
            runs[cond].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
            used[cond] = torch.get_num_threads()
    print(
        json.dumps(
            {
                "threads_used": used,
                "policy": policy if spin is None else f"{policy}, GOMP_SPINCOUNT={spin}",
                "runs": runs,
                "loadavg": os.getloadavg(),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes when contended")
    ap.add_argument("--busy-max-s", type=float, default=120.0, help="each busy loop's bound")
    ap.add_argument(
        "--settle-s", type=float, default=2.0, help="idle seconds before each run (see above)"
    )
    ap.add_argument("--threads", default="1,2,auto", help="comma list of ints or 'auto'")
    ap.add_argument("--policies", default="engine,PASSIVE,libgomp", help="see above")
    ap.add_argument("--policy", default="engine", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        child(ns)
        return
    print(f"cores in affinity {len(os.sched_getaffinity(0))}, loadavg {os.getloadavg()}")
    print(
        f"{ns.model} {ns.dtype}, {ns.num_requests} requests x prompt {ns.prompt_len} -> "
        f"{ns.output_len} tokens, {ns.busy} busy process(es) when contended, "
        f"{ns.repeats} alternated repeats; output tok/s medians"
    )
    print("| OMP_WAIT_POLICY | threads | quiet tok/s | contended tok/s | ratio | runs q / c |")
    print("|---|---|---:|---:|---:|---|")
    for policy in ns.policies.split(","):
        for threads in ns.threads.split(","):
            env = dict(os.environ)
            env.pop("OMP_WAIT_POLICY", None)
            env.pop("GOMP_SPINCOUNT", None)
            name, _, spin = policy.partition(":spin=")
            if name not in ("libgomp", "engine"):
                env["OMP_WAIT_POLICY"] = name
            if spin:
                env["GOMP_SPINCOUNT"] = spin
            keep = ("model", "dtype", "busy", "busy_max_s", "settle_s", "repeats", "num_requests")
            args = [f"--{k.replace('_', '-')}={getattr(ns, k)}" for k in keep]
            args += [f"--prompt-len={ns.prompt_len}", f"--output-len={ns.output_len}"]
            cmd = [sys.executable, __file__, *args, "--child", f"--threads={threads}"]
            cmd.append(f"--policy={policy}")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"| {policy} | {threads} | failed: {proc.stderr[-400:]!r} |")
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            q, c = (statistics.median(res["runs"][k]) for k in ("quiet", "contended"))
            u = res["threads_used"]
            used = f"{u['quiet']} quiet, {u['contended']} contended"
            fmt = "/".join
            print(
                f"| {policy} ({res['policy']}) | {threads} ({used}) | {q:.0f} | "
                f"{c:.0f} | "
                f"{c / q:.2f} | {fmt(f'{x:.0f}' for x in res['runs']['quiet'])} / "
                f"{fmt(f'{x:.0f}' for x in res['runs']['contended'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
