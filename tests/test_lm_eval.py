"""lm-eval's ``local-completions`` against a live ``iterserve serve`` scores a multiple-choice
task exactly as transformers float32 does (lm-eval's ``hf`` model on the same checkpoint): same
accuracy, every loglikelihood within 1e-3. This is what echo + logprobs is for."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from server_helpers.servers import ServerProcess

DATA = Path(__file__).parent / "data" / "lmeval"
TASK = "iterserve_tiny_mc"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lm_eval") is None,
        reason="lm-eval is not installed: pip install -e .[dev]",
    ),
]


def _evaluate(model: str, model_args: str) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's own tasks takes ~20 s
    tasks = TaskManager(include_path=str(DATA), include_defaults=False)
    return lm_eval.simple_evaluate(  # type: ignore[no-any-return]
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=tasks,
        log_samples=True,
        batch_size=1,
    )


def _loglikelihoods(res: dict[str, Any]) -> dict[tuple[int, int], float]:
    out = {}
    for s in res["samples"][TASK]:
        for j, resp in enumerate(s["resps"]):
            out[(s["doc_id"], j)] = float(resp[0][0])
    return out


def test_local_completions_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from iterserve.model.builtin import resolve_model

    path = resolve_model("tiny-random")
    monkeypatch.chdir(DATA)  # the task's data_files path is relative
    # the server boots while the reference runs (startup is mostly imports)
    server = ServerProcess("--model", "tiny-random", "--num-kv-blocks", "256")
    try:
        ref = _evaluate("hf", f"pretrained={path},dtype=float32,device=cpu")
        server.wait_ready()
        served = _evaluate(
            "local-completions",
            f"model=tiny-random,base_url={server.url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={path},num_concurrent=1,max_retries=1",
        )
    finally:
        server.stop()
    got, want = _loglikelihoods(served), _loglikelihoods(ref)
    assert len(got) == 32 and got.keys() == want.keys()
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst < 1e-3, worst
    print(f"max |loglikelihood difference| over {len(got)} choices: {worst:.2e}")
    assert all(v < 0 for v in got.values())  # real scores, not the zeros of a missing prompt
    acc = served["results"][TASK]["acc,none"]
    assert acc == ref["results"][TASK]["acc,none"]
    print(f"accuracy: served {acc}, transformers {ref['results'][TASK]['acc,none']}")
