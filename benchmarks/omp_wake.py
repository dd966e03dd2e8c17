"""What one OpenMP parallel region costs after the worker threads went idle, by spin count
(docs/SPEED.md, "An Intel Xeon with AMX-BF16 in a Firecracker VM").

    python benchmarks/omp_wake.py       # 2 threads; PASSIVE, 0 / 1,000 / 10,000 spins; ACTIVE
    python benchmarks/omp_wake.py --idle-spinners 2

A small C program (gcc -fopenmp) busy-waits ``gap`` us on the main thread, then opens an empty
parallel region, 2,000 times per gap: a region whose workers had to be woken from sleep costs
the machine's wake-up latency (on a VM, the vCPU's), one whose workers still spin costs ~1 us.
``--idle-spinners N``: N SCHED_IDLE busy loops beside it (they keep idle vCPUs from halting and
give way to any other task).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(void) {
    volatile double s = 0;
    const int n = 2000;
    #pragma omp parallel
    { s += 1; }
    const int gaps[] = {0, 5, 20, 80, 320};
    for (int g = 0; g < 5; ++g) {
        double total = 0;
        for (int i = 0; i < n; ++i) {
            double t0 = now();
            while (now() - t0 < gaps[g] * 1e-6) {}
            double a = now();
            #pragma omp parallel
            { s += 1; }
            total += now() - a;
        }
        printf("%d %.1f\n", gaps[g], total / n * 1e6);
    }
    return 0;
}
"""

SPINNER = (
    "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass\n"
)

SETTINGS = {
    "PASSIVE, 0 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
    "PASSIVE, 1,000 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
    "PASSIVE, 10,000 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle-spinners", type=int, default=0)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "wake.c"), Path(tmp, "wake")
        src.write_text(PROGRAM)
        subprocess.run(["gcc", "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        spinners = [
            subprocess.Popen([sys.executable, "-c", SPINNER]) for _ in range(ns.idle_spinners)
        ]
        try:
            rows = {}
            for name, extra in SETTINGS.items():
                env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT",)}
                env.update(extra, OMP_NUM_THREADS=str(ns.threads))
                out = subprocess.run(
                    [str(exe)], env=env, capture_output=True, text=True, check=True
                )
                rows[name] = [ln.split() for ln in out.stdout.split("\n") if ln.strip()]
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    gaps = [g for g, _ in next(iter(rows.values()))]
    print(f"{ns.threads} threads, {ns.idle_spinners} idle spinners: us per empty parallel region")
    print("| waiting | " + " | ".join(f"after {g} us" for g in gaps) + " |")
    print("|---|" + "---:|" * len(gaps))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(us for _, us in r) + " |")


if __name__ == "__main__":
    main()
