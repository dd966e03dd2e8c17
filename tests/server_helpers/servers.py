"""Start real uvicorn servers for tests: a subprocess (``python -m iterserve.server.cli``)
or an in-process app on a background thread."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.limits import ServerLimits

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m iterserve.server.cli --port P ARGS`` in a subprocess (started at once;
    ``wait_ready`` blocks until /health answers 200)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="iterserve-server-", suffix=".log", delete=False
        )  # noqa: SIM115
        cmd = [
            sys.executable,
            "-m",
            "iterserve.server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-access-log",
            "--log-level",
            "warning",
            *self.args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self._ready = False

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0, retries: int = 1) -> ServerProcess:
        if self._ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_text()
                if retries and "address already in use" in log.lower():
                    self._start()
                    return self.wait_ready(timeout, retries - 1)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    self._ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
        finally:
            self.log.close()


class ThreadServer:
    """An app served by uvicorn on a background thread of this process."""

    def __init__(self, app: Any, limits: ServerLimits | None = None) -> None:
        """With ``limits``, uvicorn runs with their HTTP limits, as ``iterserve serve`` does."""
        import uvicorn

        from iterserve.server.limits import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw: dict[str, Any] = dict(
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        config = uvicorn.Config(app, **kw) if limits is None else uvicorn_config(app, limits, **kw)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def serve(fake: Any, **kwargs: Any) -> tuple[AsyncEngine, ThreadServer]:
    """An AsyncEngine over ``fake`` and a (not yet entered) ThreadServer of its app; the
    AsyncEngine's own keyword arguments are picked out of ``kwargs``, the rest go to
    ``create_app``."""
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.app import create_app

    engine_keys = {"max_queued_requests", "max_queued_tokens", "stall_timeout_s"}
    engine_keys |= {"stream_buffer_tokens", "stream_buffer_bytes"}
    engine_kw = {k: kwargs.pop(k) for k in engine_keys if k in kwargs}
    engine = AsyncEngine(fake, **engine_kw)
    return engine, ThreadServer(create_app(engine, **kwargs), kwargs.get("limits"))


def wait_for(cond: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def parse_sse(text: str) -> list[Any]:
    """The JSON events of an SSE body, with '[DONE]' kept as the string."""
    import json

    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value} for every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def record_threads(monkeypatch: Any, module: Any, name: str) -> list[str]:
    """Wraps ``module.name`` so each call appends its thread's name to the returned list (to
    see whether work ran on the event loop or the tokenizer thread)."""
    threads: list[str] = []
    real = getattr(module, name)

    def spy(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return threads
