"""One client's call of many sequences, and how long the next clients wait behind it.

Starts ``iterserve serve`` (tiny-random by default, ``--max-num-seqs 64``), sends one big call
(a list of prompts, or prompts x n) with ``ignore_eos`` from a thread, and one second later five
small completions (4 tokens) one after the other from another client; prints each small
request's latency and the big call's own time. Under FCFS the small ones waited until most of
the big call's sequences had finished; the scheduler now shares the sequence slots between
calls (docs/SCHEDULING.md, "Calls of several sequences").

    python benchmarks/call_sharing.py
    python benchmarks/call_sharing.py --policy fair -- --tenant-weights a=1
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

CALLS: dict[str, dict[str, Any]] = {
    "256 prompts x 2000 tokens": {"prompt": ["hi there"] * 256, "max_tokens": 2000},
    "64 prompts x n=16 x 300 tokens": {"prompt": ["hi"] * 64, "max_tokens": 300, "n": 16},
}


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--port", type=int, default=8817)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--policy", default="continuous")
    ap.add_argument("--small", type=int, default=5, help="small requests after each big call")
    ap.add_argument("--log", default="/tmp/call_sharing_server.log")
    ap.add_argument("serve_args", nargs="*", help="more `iterserve serve` flags, after --")
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    cmd = [
        sys.executable, "-m", "iterserve.cli", "serve", "--model", a.model, "--port", str(a.port),
        "--max-num-seqs", str(a.max_num_seqs), "--policy", a.policy, *a.serve_args,
    ]  # fmt: skip
    with open(a.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc)
            httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            for name, body in CALLS.items():
                big: list[str] = []

                def send(body: dict[str, Any] = body, big: list[str] = big) -> None:
                    t = time.monotonic()
                    r = httpx.post(
                        url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=900
                    )
                    big.append(f"{r.status_code} in {time.monotonic() - t:.1f} s")

                th = threading.Thread(target=send)
                th.start()
                time.sleep(1.0)
                waits = []
                with httpx.Client(timeout=900) as c:
                    for _ in range(a.small):
                        t = time.monotonic()
                        r = c.post(
                            url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}
                        )
                        waits.append(f"{r.status_code} {time.monotonic() - t:.3f} s")
                th.join()
                print(
                    f"{name}: small requests {', '.join(waits)}; the big call {big[0]}", flush=True
                )
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
