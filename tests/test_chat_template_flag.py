"""``iterserve serve --chat-template``: the operator's chat template in place of the model's
(vLLM's flag), from a file or given inline."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_helpers.servers import ServerProcess

from iterserve.engine.tokenizer import load_tokenizer
from iterserve.model.builtin import resolve_model
from iterserve.server.cli import main as serve_main
from iterserve.server.templates import load_chat_template

# Each message as "role: content" on its own line, and "assistant:" to close.
PLAIN = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_file_or_the_template_itself(tmp_path: Path) -> None:
    f = tmp_path / "plain.jinja"
    f.write_text(PLAIN)
    assert load_chat_template(str(f)) == PLAIN
    assert load_chat_template(PLAIN) == PLAIN
    with pytest.raises(ValueError, match=r"'nowhere\.jinja' is not a file, nor a template"):
        load_chat_template("nowhere.jinja")
    f.write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match=r"plain\.jinja does not compile: .*\(line 1\)"):
        load_chat_template(str(f))
    with pytest.raises(ValueError, match="the template given does not compile"):
        load_chat_template("{{ unclosed")
    with pytest.raises(ValueError, match="No filter named 'nosuch'"):
        load_chat_template("{% for m in messages %}{{ m | nosuch }}{% endfor %}")
    # what transformers renders is accepted: its loop controls and {% generation %} tag
    for t in (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m }}{% endfor %}",
        "{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% endfor %}",
    ):
        assert load_chat_template(t) == t
    f.write_text("  \n")
    with pytest.raises(ValueError, match=r"plain\.jinja is empty; give a template"):
        load_chat_template(str(f))
    f.write_bytes(b"{{ m }}\xff\xfe")
    with pytest.raises(ValueError, match=r"cannot read .*plain\.jinja"):
        load_chat_template(str(f))
    with pytest.raises(ValueError, match="is a folder; give the template's file"):
        load_chat_template(str(tmp_path))


def test_the_fingerprint_follows_the_template_and_the_sampling_defaults() -> None:
    from server_helpers.fake_engine import FakeEngine

    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.serving import system_fingerprint

    def fp(template: str, defaults: dict[str, float]) -> str:
        fake = FakeEngine(chat_template=template, default_sampling=defaults)
        return system_fingerprint(AsyncEngine(fake), ["m"])

    base = fp("a", {})
    assert fp("a", {}) == base
    assert fp("b", {}) != base and fp("a", {"temperature": 0.5}) != base


def test_serve_refuses_a_bad_template_before_loading_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert serve_main(["--model", "no-such-model", "--chat-template", "nowhere.jinja"]) == 2
    err = capsys.readouterr().err
    assert "is not a file, nor a template" in err and "no-such-model" not in err


@pytest.mark.slow
def test_chat_and_tokenize_render_the_flags_template(tmp_path: Path) -> None:
    f = tmp_path / "plain.jinja"
    f.write_text(PLAIN)
    tok = load_tokenizer(resolve_model("tiny-random"))
    messages = [{"role": "user", "content": "Hello there"}]
    want = tok.encode("user: Hello there\nassistant:", add_special_tokens=False)
    own = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "user: Hello there" not in own  # the model's own template differs
    server = ServerProcess(
        "--model", "tiny-random", "--num-kv-blocks", "128", "--chat-template", str(f)
    ).wait_ready()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/tokenize", json={"messages": messages})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == want
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(want)
    finally:
        server.stop()


def test_the_fingerprint_names_the_token_budget_in_effect() -> None:
    """An unset max_num_batched_tokens and the value it defaults to configure one engine: one
    fingerprint (they differed); another budget, another one."""
    from types import SimpleNamespace

    from iterserve.config import EngineArgs
    from iterserve.server.serving import system_fingerprint

    def fp(budget: int | None, chunked: bool = True) -> str:
        args = EngineArgs(
            model="tiny-random", max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        )
        core = SimpleNamespace(
            args=args, scheduler=SimpleNamespace(config=args.scheduler_config(2048))
        )
        engine = SimpleNamespace(
            engine=core, default_sampling={}, tokenizer=None, model_path="tiny-random"
        )
        return system_fingerprint(engine, ["m"])  # type: ignore[arg-type]

    assert fp(None) == fp(512) != fp(1024)
    assert fp(None, chunked=False) == fp(2048, chunked=False) != fp(None)
