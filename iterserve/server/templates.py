"""Chat templates sent in a request, rendered in a sandbox that cannot freeze or bloat the
server.

A request template is client code. It is refused unless the server runs with
``--trust-request-chat-template`` (as vLLM), and even then it never runs in the server
process: a worker subprocess (``python -m iterserve.server.templates``) renders it with
Jinja's ``ImmutableSandboxedEnvironment``, counting loop iterations (``range``) and output
characters as it goes, under an address-space cap. The server waits at most
``--chat-template-timeout`` seconds for the answer and kills the worker past that, so the
limits hold even for a template that loops without producing output. The wait itself runs
off the event loop (the caller is a worker thread).

Wire protocol: one JSON object per line each way (``{"text": ...}`` or ``{"error": ...}``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

WORKER_MEMORY_BYTES = 1 << 30  # the worker's address-space cap (RLIMIT_AS)


class TemplateError(ValueError):
    """The template failed, or ran past a limit: the client's to fix (a 400)."""


def load_chat_template(value: str, what: str = "--chat-template") -> str:
    """``--chat-template``'s template: the file ``value`` names, or ``value`` itself when it
    holds Jinja (as vLLM's flag). Raises ValueError, starting with ``what`` (the flag or
    argument it came from), saying what to change when it is neither, cannot be read, is
    empty or does not compile. The operator's own template, so it renders as the model's
    does (transformers' sandboxed ``apply_chat_template``, in the server process), not in
    the request sandbox."""
    import jinja2

    if os.path.isdir(value):
        raise ValueError(f"{what}: {value!r} is a folder; give the template's file")
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{what}: cannot read {value!r}: {e}") from None
        where = value
    elif any(c in value for c in "{}\n"):
        template, where = value, "the template given"
    else:
        raise ValueError(
            f"{what}: {value!r} is not a file, nor a template (no Jinja in it); give "
            "the path of a .jinja file or the template itself"
        )
    if not template.strip():
        raise ValueError(f"{what}: {where} is empty; give a template")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        msg = f"{what}: {where} does not compile: {e} (line {e.lineno})"
        raise ValueError(msg) from None
    return template


def _compile(template: str) -> None:
    """Compiles ``template`` as transformers' ``apply_chat_template`` would, so what it
    renders is accepted."""
    _environment().from_string(template)


def _environment() -> Any:
    """A Jinja environment like the one transformers renders chat templates in (its own is
    private): sandboxed, its loop controls, the ``{% generation %}`` tag (its body rendered as
    written), ``tojson`` with its options and no HTML escaping, ``raise_exception``,
    ``strftime_now`` (Llama 3's templates date the system prompt), ``dict``, and a
    ``namespace`` that refuses underscore-named attributes."""
    import datetime

    import jinja2.utils
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.exceptions import TemplateError as JinjaTemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace cannot hold {name!r} (underscore-prefixed)")

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message: str) -> None:
        raise JinjaTemplateError(message)

    class TemplateDict:  # dict(...) and dict.fromkeys(...), as transformers gives them
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def strftime_now(format: str) -> str:  # noqa: A002 - transformers' keyword name
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=Namespace,
    )
    return env


class TemplateSandbox:
    """One long-lived worker process; ``render`` is thread-safe (one render at a time)."""

    def __init__(self, *, timeout: float, max_chars: int, max_loop_iterations: int) -> None:
        self.timeout = timeout
        self.max_chars = max_chars
        self.max_loop_iterations = max_loop_iterations
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "iterserve.server.templates"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONHASHSEED": "0"},
            )
            # Its start-up (imports) is not the template's time: wait for "ready" first.
            assert self._proc.stdout is not None
            ready, _, _ = select.select([self._proc.stdout], [], [], 60.0)
            if not ready or not self._proc.stdout.readline():
                self._kill()
                raise RuntimeError("the chat-template worker process did not start")
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def render(
        self,
        template: str,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: dict[str, Any],
    ) -> str:
        """The rendered prompt text; raises TemplateError (what went wrong, which limit)."""
        job = {
            "template": template,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "variables": variables,
            "max_chars": self.max_chars,
            "max_loop_iterations": self.max_loop_iterations,
        }
        line = json.dumps(job).encode() + b"\n"
        with self._lock:
            proc = self._worker()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
                reply = proc.stdout.readline() if ready else b""
            except OSError:
                reply = b""
            if not reply:
                self._kill()
                raise TemplateError(
                    f"chat template did not finish rendering within {self.timeout}s "
                    "(--chat-template-timeout); simplify the template"
                )
        result = json.loads(reply)
        if "error" in result:
            raise TemplateError(result["error"])
        return str(result["text"])


# ---- the worker process ------------------------------------------------------------------------
class _Limits:
    def __init__(self, max_loop_iterations: int) -> None:
        self.left = max_loop_iterations
        self.max = max_loop_iterations

    def range(self, *args: int) -> Any:
        r = range(*args)
        self.left -= len(r)
        if self.left < 0:
            raise TemplateError(
                f"chat template ran more than {self.max} loop iterations "
                "(--chat-template-max-loop-iterations)"
            )
        return r


def _render_job(job: dict[str, Any]) -> str:
    limits = _Limits(int(job["max_loop_iterations"]))

    def raise_exception(message: str) -> None:
        raise TemplateError(f"chat template raised: {message}")

    env = _environment()
    env.globals.update(range=limits.range, raise_exception=raise_exception)
    tmpl = env.from_string(job["template"])
    max_chars = int(job["max_chars"])
    parts: list[str] = []
    size = 0
    context = {
        **job["variables"],
        "messages": job["messages"],
        "add_generation_prompt": job["add_generation_prompt"],
    }
    for chunk in tmpl.generate(**context):
        size += len(chunk)
        if size > max_chars:
            raise TemplateError(
                f"chat template rendered more than {max_chars} characters "
                "(--chat-template-max-chars)"
            )
        parts.append(chunk)
    text = "".join(parts)
    if job["continue_final_message"] and job["messages"]:
        final = str(job["messages"][-1].get("content") or "").strip()
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    return text


def _worker_main() -> None:
    import resource

    import jinja2.sandbox  # noqa: F401 - imported before "ready", not inside a render's time

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            reply: dict[str, str] = {"text": _render_job(json.loads(line))}
        except TemplateError as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply = {"error": "chat template used too much memory; simplify the template"}
        except Exception as e:  # noqa: BLE001 - any template failure is the client's to fix
            reply = {"error": f"chat template failed: {type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _worker_main()
