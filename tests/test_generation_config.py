"""The model's sampling defaults from its generation_config.json (vLLM's ``--generation-config
auto``): what requests that leave a sampling field unset get, offline and over HTTP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import parse_sse, serve

from iterserve.config import EngineArgs
from iterserve.engine import LLM
from iterserve.model.builtin import resolve_model
from iterserve.sampling_params import SamplingParams, sampling_defaults
from iterserve.server.cli import build_parser as build_serve_parser
from iterserve.server.cli import main as serve_main

QWEN3_LIKE = {  # Qwen3's generation_config.json, in substance
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def test_the_sampling_keys_are_read_and_the_rest_ignored() -> None:
    assert sampling_defaults(QWEN3_LIKE) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    got = sampling_defaults(
        {
            "max_new_tokens": 64,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0,
            "min_p": 0.05,
            "top_k": -1,
            "temperature": None,  # null sets nothing
            "max_length": 4096,  # not a sampling default (vLLM reads only max_new_tokens)
        }
    )
    assert got == {
        "max_tokens": 64,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.0,
        "min_p": 0.05,
        "top_k": 0,
    }
    assert isinstance(got["max_tokens"], int) and isinstance(got["frequency_penalty"], float)
    # overrides win, and may add keys
    over = sampling_defaults(QWEN3_LIKE, {"temperature": 0.2, "max_new_tokens": 8})
    assert over == {"temperature": 0.2, "top_k": 20, "top_p": 0.95, "max_tokens": 8}
    assert sampling_defaults({}) == {}


FILE_FIX = r"fix the file, override the key \(--override-generation-config\) or ignore the file"
OVER = r"override_generation_config \(--override-generation-config\)"


@pytest.mark.parametrize(
    ("config", "overrides", "match"),
    [
        ({"top_p": 1.5}, None, r"x\.json sets top_p to 1\.5, .*must be in \(0, 1\].*" + FILE_FIX),
        ({"temperature": "hot"}, None, "x.json sets temperature to 'hot': it must be a number"),
        ({"top_k": 20.0}, None, "x.json sets top_k to 20.0: it must be an integer"),
        ({"max_new_tokens": True}, None, "x.json sets max_new_tokens to True: it must be an int"),
        ({"max_new_tokens": 0}, None, r"x\.json sets max_new_tokens to 0, .*max_tokens must be"),
        ({}, {"seed": 3}, OVER + r": \['seed'\] are not sampling defaults; use only"),
        ({}, {"top_p": 0}, OVER + r" sets top_p to 0, .*; send another override"),
    ],
)  # fmt: skip
def test_a_bad_default_is_refused_naming_its_source_key_and_fix(
    config: dict[str, Any], overrides: dict[str, Any] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        sampling_defaults(config, overrides, "x.json")


def test_overrides_fix_add_and_remove_the_files_values() -> None:
    assert sampling_defaults({"top_p": 1.5}, {"top_p": 0.5}) == {"top_p": 0.5}
    assert sampling_defaults(QWEN3_LIKE, {"top_k": None}) == {"temperature": 0.6, "top_p": 0.95}
    assert sampling_defaults({}, {"min_p": 0.1}) == {"min_p": 0.1}


def test_engine_args_validate_the_override_at_once() -> None:
    with pytest.raises(ValueError, match=r"\['bogus'\] are not sampling defaults"):
        EngineArgs(override_generation_config={"bogus": 1})
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineArgs(override_generation_config=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineArgs(generation_config="")


def _model_with(tmp_path: Path, generation: dict[str, Any]) -> Path:
    """tiny-random's folder (its files linked) with ``generation`` added to its
    generation_config.json."""
    src = Path(resolve_model("tiny-random"))
    out = tmp_path / "model"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, out / f.name)
    gen = json.loads((src / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **generation}))
    return out


def test_the_folder_defaults_come_from_generation_config(tmp_path: Path) -> None:
    folder = _model_with(tmp_path, QWEN3_LIKE | {"max_new_tokens": 9})
    args = EngineArgs(model=str(folder))
    want = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 9}
    assert args.sampling_defaults(str(folder)) == want
    assert args.replace(generation_config="vllm").sampling_defaults(str(folder)) == {}
    # another folder's file; the model's own is then not read
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert args.replace(generation_config=str(other)).sampling_defaults(str(folder)) == {
        "temperature": 0.3
    }
    with pytest.raises(FileNotFoundError, match="expected a folder with a generation_config"):
        args.replace(generation_config=str(tmp_path / "nowhere")).sampling_defaults(str(folder))
    gen_file = str(other / "generation_config.json")
    with pytest.raises(FileNotFoundError, match="a file; pass the folder that holds it"):
        args.replace(generation_config=gen_file).sampling_defaults(str(folder))
    # "vllm" ignores the file, not the overrides
    over = args.replace(generation_config="vllm", override_generation_config={"top_p": 0.9})
    assert over.sampling_defaults(str(folder)) == {"top_p": 0.9}
    (other / "generation_config.json").write_text("{temperature: 0.3}")
    with pytest.raises(ValueError, match=r"other/generation_config\.json is not valid JSON"):
        args.replace(generation_config=str(other)).sampling_defaults(str(folder))
    # max_new_tokens is a server-wide limit from a FOLDER's file or an override (vLLM's
    # override_max_tokens), only a default from the model's own file
    assert args.max_tokens_cap(want) is None
    assert args.replace(override_generation_config={"max_new_tokens": 3}).max_tokens_cap({}) == 3
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    folder_args = args.replace(generation_config=str(other))
    assert folder_args.max_tokens_cap(folder_args.sampling_defaults(str(folder))) == 7
    # tiny-random's own file names only bos / eos / pad: no sampling defaults
    assert EngineArgs().sampling_defaults(resolve_model("tiny-random")) == {}


def test_llm_generate_without_params_uses_the_models_defaults(tmp_path: Path) -> None:
    """A greedy default (temperature 0) with max_new_tokens: generate() with no params gives
    exactly the explicit greedy params' tokens; explicit params win over the defaults."""
    folder = _model_with(tmp_path, {"temperature": 0.0, "top_k": 20, "max_new_tokens": 6})
    llm = LLM(model=str(folder), num_kv_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 6)
    assert defaults.top_p == 1.0 and defaults.n == 1  # the rest at SamplingParams' own
    prompts = ["Hello, my name is", "The capital of France is"]
    got = llm.generate(prompts)
    want = llm.generate(prompts, SamplingParams(temperature=0.0, top_k=20, max_tokens=6))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(1 <= len(o.outputs[0].token_ids) <= 6 for o in got)
    explicit = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    assert all(len(o.outputs[0].token_ids) <= 2 for o in explicit)
    # --generation-config vllm: the neutral defaults
    plain = LLM(model=str(folder), num_kv_blocks=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    over = LLM(model=str(folder), num_kv_blocks=64, override_generation_config={"top_k": 5})
    assert over.get_default_sampling_params().top_k == 5
    assert over.get_default_sampling_params().max_tokens == 6


class _Recording(FakeEngine):
    """The fake engine, keeping the params of every request it was given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.given: list[SamplingParams] = []

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *args: Any, **kwargs: Any) -> None:  # fmt: skip
        self.given.append(params)
        super().add_request(request_id, prompt, params, *args, **kwargs)


def _params_of(fake: _Recording) -> SamplingParams:
    (params,) = fake.given
    fake.given.clear()
    return params


def test_server_requests_take_the_defaults_they_leave_unset() -> None:
    defaults = {
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "max_tokens": 5,
    }
    fake = _Recording(max_model_len=64, default_sampling=defaults)
    _, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        # chat leaving every sampling field unset: all defaults, max_tokens capped at 5
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        p = _params_of(fake)
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.5, 7, 0.1)
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
        assert p.max_tokens == 5
        # what the request sets wins, null included as "unset"
        body = {
            "prompt": "hello",
            "temperature": 1.0,
            "top_k": 0,
            "presence_penalty": None,
            "max_tokens": 3,
        }
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        p = _params_of(fake)
        assert (p.temperature, p.top_k, p.presence_penalty, p.top_p) == (1.0, 0, 0.5, 0.5)
        assert p.max_tokens == 3 and r.json()["usage"]["completion_tokens"] == 3
        # completions' max_tokens is 16 when not sent or sent as null (as vLLM): no default
        for body in ({"prompt": "hello"}, {"prompt": "hello", "max_tokens": None}):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and _params_of(fake).max_tokens == 16
        # chat's max_completion_tokens (or max_tokens) beats the default
        hi = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"messages": hi, "max_completion_tokens": 2})
        assert r.json()["usage"]["completion_tokens"] == 2 and _params_of(fake).max_tokens == 2
        # a prompt with less room than the default: capped at the room, not a 400
        long = [{"role": "user", "content": "x" * 44}]  # 62 tokens with the template
        r = c.post("/v1/chat/completions", json={"messages": long})
        assert r.status_code == 200, r.text
        room = 64 - r.json()["usage"]["prompt_tokens"]
        assert 0 < room < 5 and _params_of(fake).max_tokens == room
        assert r.json()["choices"][0]["finish_reason"] == "length"
        # an explicit max_tokens reaches the engine as sent (over the room, the real engine's
        # 400: its reject_overlong_max_tokens)
        r = c.post("/v1/chat/completions", json={"messages": long, "max_tokens": 5})
        assert _params_of(fake).max_tokens == 5
        # min_tokens above a default max_tokens the request did not send
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "min_tokens": 6},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
        assert "send max_tokens" in r.json()["error"]["message"]
        assert fake.given == []
        # /v1/responses goes through chat: what it leaves unset takes the defaults
        r = c.post("/v1/responses", json={"input": "hi"})
        assert r.status_code == 200, r.text
        assert (r.json()["temperature"], r.json()["top_p"]) == (0.0, 0.5)
        p = _params_of(fake)
        assert (p.top_k, p.presence_penalty, p.repetition_penalty, p.max_tokens) == (7, 0.5, 1.2, 5)


def test_the_servers_max_tokens_limit_bounds_every_request() -> None:
    fake = _Recording(max_model_len=64, default_sampling={"max_tokens": 5}, max_tokens_cap=4)
    _, server = serve(fake)
    hi = [{"role": "user", "content": "hi"}]
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        for path, body in (
            ("/v1/completions", {"prompt": "hello"}),  # completions' 16
            ("/v1/completions", {"prompt": "hello", "max_tokens": 10}),
            ("/v1/chat/completions", {"messages": hi}),  # the default 5
            ("/v1/chat/completions", {"messages": hi, "max_completion_tokens": 30}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4 and _params_of(fake).max_tokens == 4
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and _params_of(fake).max_tokens == 2
        # the prompt's room bounds what the request did not send: completions' 16 included
        r = c.post("/v1/completions", json={"prompt": ["hello", "x" * 62]})
        assert r.status_code == 200, r.text
        assert sorted(p.max_tokens for p in fake.given) == [2, 4]
        fake.given.clear()
        # the metric counts what each sequence runs with (as vLLM), sent or not
        from server_helpers.servers import metric_values

        before = metric_values(c.get("/metrics").text)
        r = c.post("/v1/completions", json={"prompt": ["hello", "x" * 62], "n": 2})
        assert r.status_code == 200 and len(fake.given) == 2
        fake.given.clear()
        after = metric_values(c.get("/metrics").text)
        for name in ("iterserve:request_params_max_tokens", "vllm:request_params_max_tokens"):
            key = name + ("_count" if name.startswith("iterserve") else '_count{engine="0"}')
            assert after[key] - before[key] == 4  # 2 prompts x n 2
            key = key.replace("_count", "_sum")
            assert after[key] - before[key] == 2 * 4 + 2 * 2
        # min_tokens no prompt leaves room for: refused before tokenizing
        r = c.post("/v1/chat/completions", json={"messages": hi, "min_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
        assert "more than the context (max_model_len 64)" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "hello", "min_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
        msg = r.json()["error"]["message"]
        assert "here 4: the server's limit" in msg and "lower min_tokens" in msg
        assert fake.given == []


def test_serve_refuses_a_bad_generation_config_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _model_with(tmp_path, {"top_p": 2.0})
    assert serve_main(["--model", str(folder), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json sets top_p to 2.0, which SamplingParams refuses" in err
    assert "ignore the file (--generation-config vllm)" in err and "Traceback" not in err
    assert serve_main(["--override-generation-config", '{"seed": 1}']) == 2
    assert "['seed'] are not sampling defaults" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--override-generation-config", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_a_default_max_tokens_past_the_room_is_capped_on_the_real_engine(tmp_path: Path) -> None:
    """The server's real engine refuses an explicit max_tokens past the context's room (as
    OpenAI does; vLLM 0.32 clamps it); the model's default one, the file's or an override's,
    is capped at the room instead; min_tokens past the room is refused rather than quietly
    not met."""
    from iterserve.engine.llm_engine import LLMEngine

    folder = _model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 1000})
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "ignore_eos": True}
    for override, want_room in ((None, True), ({"max_new_tokens": 3}, False)):
        eng = LLMEngine(
            EngineArgs(
                model=str(folder),
                num_kv_blocks=64,
                max_model_len=48,
                override_generation_config=override,
            )
        )
        eng.reject_overlong_max_tokens = True
        _, server = serve(eng)
        with server, httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            want = 48 - usage["prompt_tokens"] if want_room else 3
            assert usage["completion_tokens"] == want
            r = c.post("/v1/chat/completions", json=chat | {"max_tokens": 1000})
            if want_room:  # an explicit max_tokens past the room: the engine's 400 (OpenAI's)
                assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            else:  # the override's max_new_tokens limits it first (vLLM's override_max_tokens)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            r = c.post("/v1/chat/completions", json=chat | {"min_tokens": 45, "max_tokens": 45})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
            # completions' own 16 is a default too, left out or null: capped at the room (8)
            for extra in ({}, {"max_tokens": None}):
                body = {"prompt": [5] * 40, "ignore_eos": True} | extra
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == (8 if want_room else 3)
            # sent, 16 is the client's: past the room a 400, unless the limit brings it in
            r = c.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 16})
            assert r.status_code == (400 if want_room else 200), r.text
            if not want_room:  # still past the room after the limit: the 400 quotes what was sent
                r = c.post("/v1/completions", json={"prompt": [5] * 46, "max_tokens": 10})
                assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
                assert "46 in the prompt, 10 in the completion" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": [5] * 40, "min_tokens": 9})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
            # no max_tokens: the default (capped at the room) is less than min_tokens
            r = c.post("/v1/chat/completions", json=chat | {"min_tokens": 45})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    # --allow-auto-truncate (SGLang's flag; vLLM 0.32's behaviour): an explicit max_tokens
    # past the room is cut to it, streamed or not; min_tokens past the room stays a 400
    eng = LLMEngine(EngineArgs(model=str(folder), num_kv_blocks=64, max_model_len=48))
    eng.reject_overlong_max_tokens = False  # what the flag sets
    _, server = serve(eng)
    with server, httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=chat | {"max_tokens": 1000})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 48 - usage["prompt_tokens"]
        r = c.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 16, "stream": True})
        assert r.status_code == 200 and r.text.count('"finish_reason":"length"') == 1, r.text
        r = c.post("/v1/completions", json={"prompt": [5] * 40, "min_tokens": 9, "max_tokens": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    ns = build_serve_parser().parse_args(["--allow-auto-truncate"])
    assert ns.allow_auto_truncate and not build_serve_parser().parse_args([]).allow_auto_truncate
    llm = LLM(model=str(folder), num_kv_blocks=64, max_model_len=48)
    with pytest.raises(ValueError, match="min_tokens is 45 but the context"):
        llm.generate([[5] * 8], SamplingParams(max_tokens=None, min_tokens=45))


def test_generate_flags_beat_the_models_defaults_which_beat_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from iterserve import cli

    folder = str(_model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 4}))
    argv = ["generate", "--model", folder, "--prompt", "Hello", "--num-kv-blocks", "64"]
    for extra, tokens in (
        ([], 4),
        (["--max-tokens", "2"], 2),
        (["--generation-config", "vllm"], 32),
    ):
        assert cli.main(argv + extra) == 0
        out = capsys.readouterr().out
        assert f"-> ({tokens} tokens, length)" in out, (extra, out)


def test_a_capped_default_holds_for_streams_n_best_of_echo_and_responses() -> None:
    fake = _Recording(max_model_len=64, default_sampling={"max_tokens": 5}, max_tokens_cap=6)
    _, server = serve(fake)
    hi = [{"role": "user", "content": "hi"}]
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        body = {"messages": hi, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [e for e in parse_sse(r.read().decode()) if e != "[DONE]"]
        assert events[-1]["usage"]["completion_tokens"] == 2 * 5
        assert _params_of(fake).max_tokens == 5
        # completions: best_of candidates and echo run with completions' 16 at most the limit
        r = c.post("/v1/completions", json={"prompt": "hi", "n": 1, "best_of": 2, "echo": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6 and _params_of(fake).max_tokens == 6
        # truncate_prompt_tokens: the room after the cut
        body = {"prompt": "x" * 80, "truncate_prompt_tokens": 60}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert _params_of(fake).max_tokens == 4  # 64 - 60
        # /v1/responses: max_output_tokens above the limit runs at the limit
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 50})
        assert r.status_code == 200, r.text
        assert _params_of(fake).max_tokens == 6
        assert r.json()["usage"]["output_tokens"] == 6


def test_the_tokenizers_eos_stops_too_beside_the_configs(tmp_path: Path) -> None:
    # vLLM stops on the tokenizer's EOS and the generation config's ids; the config's alone
    # let a fine-tune whose tokenizer ends on another token run to max_tokens
    from iterserve.model.builtin import make_test_checkpoint

    folder = make_test_checkpoint(str(tmp_path / "m"), arch="llama")
    gen = {"bos_token_id": 1, "eos_token_id": [4]}
    (Path(folder) / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(folder, dtype="float32")
    tok_eos = llm.engine.tokenizer.eos_token_id
    assert tok_eos is not None and tok_eos != 4
    assert llm.engine.eos_token_ids == {4, tok_eos}
    p = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={tok_eos: 100.0})
    out = llm.generate(["The quick brown fox"], p)[0].outputs[0]
    assert list(out.token_ids) == [tok_eos] and out.finish_reason == "stop"
    assert out.stop_reason is None
    # the config's id stops with itself as the stop_reason, as vLLM (which adds it to
    # stop_token_ids) reports it; under ignore_eos it does not stop
    p = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={4: 100.0})
    out = llm.generate(["The quick brown fox"], p)[0].outputs[0]
    assert list(out.token_ids) == [4] and (out.finish_reason, out.stop_reason) == ("stop", 4)
    p = SamplingParams(max_tokens=3, temperature=0.0, logit_bias={4: 100.0}, ignore_eos=True)
    out = llm.generate(["The quick brown fox"], p)[0].outputs[0]
    assert list(out.token_ids) == [4, 4, 4] and (out.finish_reason, out.stop_reason) == (
        "length",
        None,
    )
