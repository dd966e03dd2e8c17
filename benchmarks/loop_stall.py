"""How long one request with many logprobs holds the server's event loop (docs/RELIABILITY.md,
"Answers with many logprobs").

    python benchmarks/loop_stall.py
    python benchmarks/loop_stall.py --rounds 3 --prompt-tokens 2040

Starts ``iterserve serve --model tiny-random`` on a free port. A probe client asks for
``/v1/models`` every 2 ms (the event loop answers it alone, so its latency is how long the loop
was held); meanwhile another client sends ``--rounds`` completions of a ``--prompt-tokens``-token
prompt, ``max_tokens`` 1, each case's way: no logprobs, ``prompt_logprobs: 20``, ``echo`` with
``logprobs: 20``, and that echo streamed. Prints the probe's max and p99 latency per case.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_compare import wait_ready  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "no logprobs": {},
    "prompt_logprobs 20": {"prompt_logprobs": 20},
    "echo + logprobs 20": {"echo": True, "logprobs": 20},
    "streamed echo + lp 20": {"echo": True, "logprobs": 20, "stream": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe_case(base: str, extra: dict[str, Any], rounds: int, prompt_tokens: int) -> list[float]:
    """The probe's latencies while ``rounds`` requests with ``extra`` run one after another."""
    lat: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                c.get("/v1/models")
                lat.append(time.monotonic() - t0)
                time.sleep(0.002)

    t = threading.Thread(target=probe)
    t.start()
    time.sleep(0.5)
    body = {"prompt": [10 + i % 1000 for i in range(prompt_tokens)], "max_tokens": 1, **extra}
    for _ in range(rounds):
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
    stop.set()
    t.join()
    return sorted(lat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2040, help="under tiny-random's 2,048")
    a = ap.parse_args(argv)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "iterserve.server.cli", "--model", "tiny-random"]
    cmd += ["--port", str(port)]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(base, server, 180.0)
            for name, extra in CASES.items():
                lat = probe_case(base, extra, a.rounds, a.prompt_tokens)
                p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
                print(
                    f"{name:>20}: probe max {lat[-1] * 1e3:6.1f} ms, p99 {p99 * 1e3:6.1f} ms "
                    f"({len(lat)} probes)"
                )
        finally:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
