"""How long one client's small requests wait behind another client's big multi-prompt call
(docs/RELIABILITY.md, "One client's big call").

    python benchmarks/big_call.py                         # the default policy (continuous)
    python benchmarks/big_call.py --anonymous             # the same, no `user` sent
    python benchmarks/big_call.py --policy fair           # fair share by user / x-tenant

Starts ``iterserve serve --model tiny-random --max-num-seqs 64`` (plus the given serve flags)
on a free port. For each big call (256 prompts x 2,000 tokens; 64 prompts x n = 16 x 300
tokens; ``ignore_eos``, OpenAI ``user`` "big" unless ``--anonymous``), it sends the call,
waits a second, then sends ``--small`` requests one after the other (4 tokens, ``user``
"small") and prints each one's latency and the big call's. Under plain FCFS (vLLM's default)
the small requests queue behind every sequence of the big call that arrived first; the
default ``continuous`` policy shares the slots between calls, and ``--policy fair`` between
the users (tenants): either way a small request takes a slot from the big call at the next
step.
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

BIG_CALLS: dict[str, dict[str, Any]] = {
    "256 prompts x 2,000 tokens": {"prompt": ["hi there"] * 256, "max_tokens": 2000},
    "64 prompts x n 16 x 300 tokens": {"prompt": ["hi"] * 64, "max_tokens": 300, "n": 16},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Other arguments go to `iterserve serve` (e.g. --policy fair).",
    )
    ap.add_argument("--small", type=int, default=5, help="small requests sent during each call")
    ap.add_argument("--delay-s", type=float, default=1.0, help="seconds from the big call to them")
    ap.add_argument("--anonymous", action="store_true", help="send no `user` field")
    args, serve_args = ap.parse_known_args(argv)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "iterserve.cli", "serve", "--model", "tiny-random",
        "--port", str(port), "--max-num-seqs", "64", *serve_args,
    ]  # fmt: skip
    print("server:", " ".join(cmd[2:]), flush=True)
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(base, server, 180.0)
            httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            for name, call in BIG_CALLS.items():
                who = {} if args.anonymous else {"user": "big"}
                body = {**call, "ignore_eos": True, **who}
                big: dict[str, Any] = {}

                def send(body: dict[str, Any] = body, big: dict[str, Any] = big) -> None:
                    t = time.monotonic()
                    r = httpx.post(base + "/v1/completions", json=body, timeout=1800)
                    big.update(status=r.status_code, seconds=time.monotonic() - t)

                th = threading.Thread(target=send)
                th.start()
                time.sleep(args.delay_s)
                waits = []
                with httpx.Client(timeout=1800) as c:
                    for _ in range(args.small):
                        t = time.monotonic()
                        r = c.post(
                            base + "/v1/completions",
                            json={
                                "prompt": "hello there",
                                "max_tokens": 4,
                                **({} if args.anonymous else {"user": "small"}),
                            },
                        )
                        r.raise_for_status()
                        waits.append(time.monotonic() - t)
                th.join()
                print(
                    f"{name}: small requests {', '.join(f'{w:.3f}' for w in waits)} s; "
                    f"the big call {big.get('status')} in {big.get('seconds', 0.0):.1f} s",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
