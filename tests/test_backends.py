"""Attention backends and load-time strategies.

The whole engine with the ``torch`` and ``triton`` attention backends stays token-exact against
transformers (float32) through chunked prefill, preemption and prefix-cache hits; the ``cpu``
backend (auto, where the C++ kernels build) is what every other test runs. Without a GPU the
Triton kernels run under TRITON_INTERPRET=1 (set before they are imported), which is slow: a
tiny model and few tokens.
"""

from __future__ import annotations

import importlib
import os
import random
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from iterserve import LLM, SamplingParams  # noqa: E402
from iterserve.model import attention_backends as ab  # noqa: E402
from iterserve.model import kernels, layers  # noqa: E402
from iterserve.model.attention import StepItem  # noqa: E402
from iterserve.model.autotune import ByRows  # noqa: E402
from iterserve.model.builtin import make_test_checkpoint  # noqa: E402
from iterserve.model.cpu import needs_upcast  # noqa: E402
from iterserve.model.llama import DecoderLayer  # noqa: E402
from iterserve.model.runner import ModelRunner  # noqa: E402
from tests.test_engine import _hf_greedy  # noqa: E402

try:
    from iterserve.model import triton_attention as ta

    HAS_TRITON = ta.HAS_TRITON
except ImportError:
    HAS_TRITON = False

if HAS_TRITON and not torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(ta._write_kv_kernel, InterpretedFunction):
        # Imported earlier in this process without the interpreter: rebuild the kernels.
        importlib.reload(ta)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
MAX_TOKENS = 6
# Budget 12 splits every prompt over 12 tokens into chunks; 10 blocks of 4 tokens cannot hold
# all six requests at once, so some are preempted and recomputed (their blocks stay cached).
WORKLOAD: dict[str, Any] = {
    "block_size": 4,
    "num_kv_blocks": 10,
    "max_num_batched_tokens": 12,
    "max_num_seqs": 6,
}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = make_test_checkpoint(str(tmp_path_factory.mktemp("llama")), arch="llama")
    import json

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(16)]  # 4 full blocks shared by three
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    prompts += [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))] for _ in "abc"]
    return {"path": path, "prompts": prompts, "ref": _hf_greedy(path, prompts, MAX_TOKENS)}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_engine_is_token_exact_with_backend(
    oracle: dict[str, Any], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ab.ENV, backend)
    llm = LLM(oracle["path"], dtype="float32", seed=0, **WORKLOAD)
    assert llm.engine.runner.attention.name == backend
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # The first three, then the three sharing a prefix: the later ones hit the cached blocks.
    outs = llm.generate(oracle["prompts"][:3], greedy)
    outs += llm.generate(oracle["prompts"][3:], greedy)
    for i, (o, ref) in enumerate(zip(outs, oracle["ref"])):
        assert o.outputs[0].token_ids == ref, f"{backend}: prompt {i} differs"
    st = llm.stats()
    assert st["num_preemptions"] > 0, st
    assert st["prefix_cache_hit_tokens"] > 0, st
    assert st["kv_blocks_used"] == 0
    llm.engine.check_integrity()


def _mixed_step(block_size: int) -> tuple[list[StepItem], int]:
    """Two decodes, a chunk after a cached prefix, a fresh prompt; scattered blocks."""
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [perm[i * 10 : (i + 1) * 10] for i in range(4)]
    specs = [(1, 9), (1, 22), (5, 13), (7, 0)]  # (new tokens, start position)
    return [StepItem(n, p0, tables[i]) for i, (n, p0) in enumerate(specs)], 2


def _run_backend(
    backend: ab.AttentionBackend[Any], items: list[StepItem], num_decodes: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    bs, kvh, group, hd = 4, 2, 4, 32
    k_cache = torch.randn(40 * bs, kvh, hd)
    v_cache = torch.randn(40 * bs, kvh, hd)
    T = sum(it.num_tokens for it in items)
    q, k, v = torch.randn(T, kvh * group, hd), torch.randn(T, kvh, hd), torch.randn(T, kvh, hd)
    step = ab.StepMetadata(items, num_decodes, bs, window, torch.float32, torch.device("cpu"))
    out = backend(q, k, v, k_cache, v_cache, backend.build_metadata(step))
    return out, k_cache


@pytest.mark.parametrize("window", [None, 6])
def test_backends_agree_on_a_mixed_step(window: int | None) -> None:
    """torch, cpu and triton on the same ragged step (decodes, a continued chunk, a fresh
    prompt; GQA 4), with and without a sliding window: same output, same cache writes."""
    items, nd = _mixed_step(4)
    ref, ref_cache = _run_backend(ab.TorchBackend(), items, nd, window)
    assert ref.shape == (sum(it.num_tokens for it in items), 8 * 32)
    others: list[ab.AttentionBackend[Any]] = []
    kern = kernels.load()
    if kern is not None:
        others.append(ab.CpuBackend(kern))
    if HAS_TRITON:
        others.append(ab.TritonBackend())
    decode_only = [StepItem(1, it.start_pos + it.num_tokens - 1, it.block_table) for it in items]
    dref, _ = _run_backend(ab.TorchBackend(), decode_only, len(decode_only), window)
    for backend in others:
        out, cache = _run_backend(backend, items, nd, window)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, msg=backend.name)
        assert torch.equal(cache, ref_cache), backend.name
        dout, _ = _run_backend(backend, decode_only, len(decode_only), window)
        torch.testing.assert_close(dout, dref, atol=2e-5, rtol=2e-5, msg=backend.name)


def test_backend_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ab.ENV, "cuda")
    with pytest.raises(ValueError, match="ITERSERVE_ATTENTION_BACKEND must be one of auto"):
        ModelRunner("tiny-random")
    monkeypatch.setenv(ab.ENV, "cpu")
    monkeypatch.setenv("ITERSERVE_KERNELS", "0")
    with pytest.raises(ValueError, match="cpu attention backend needs iterserve's C.. kernels"):
        ModelRunner("tiny-random")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="float32/bfloat16"):
        ab.select_backend("cpu", torch.float16, cpu, kernels.Kernels.__new__(kernels.Kernels))
    with pytest.raises(ValueError, match="attention backend must be one of auto"):
        ModelRunner("tiny-random", attention_backend="sdpa")
    assert ModelRunner("tiny-random", attention_backend="torch").attention.name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ab.select_backend("triton", torch.float32, cpu, None)


def test_auto_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the C++ decode kernel where it builds (f32/bf16), else the torch reference."""
    monkeypatch.delenv(ab.ENV, raising=False)
    built = kernels.load() is not None
    assert ModelRunner("tiny-random").attention.name == ("cpu" if built else "torch")
    assert ModelRunner("tiny-random", dtype="float16").attention.name == "torch"
    monkeypatch.setenv("ITERSERVE_KERNELS", "0")
    assert ModelRunner("tiny-random").attention.name == "torch"


def test_strategies_are_chosen_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each projection is one strategy module after load and the raw parameters are gone; the
    choice follows ITERSERVE_KERNELS (fixed paths here; measured ones: test_autotune.py)."""
    monkeypatch.setenv("ITERSERVE_PACK_WEIGHTS", "0")
    monkeypatch.setenv("ITERSERVE_KERNELS", "0")
    layer = ModelRunner("tiny-random").model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert not hasattr(layer, "qkv_proj") and not hasattr(layer, "qkv_bias")
    assert all(type(getattr(layer, n)) is layers.TorchLinear for n in DecoderLayer.LINEARS)
    assert type(layer.input_norm) is layers.RMSNorm and type(layer.rotary) is layers.Rotary
    bf16 = ModelRunner("tiny-random", dtype="bfloat16").model.layers[0]  # torch's, measured
    # One path, or a route by rows: where bf16 is emulated, upcasting wins from some row count
    # on; where it is native, torch's prepacked oneDNN copy is a candidate too (measured at
    # tiny-random's shapes, any of them can win a bucket).
    torch_paths = (layers.UpcastLinear, layers.BucketedLinear, layers.OneDNNLinear)
    qkv = bf16.qkv
    parts = [fn for _, fn in qkv.table] if isinstance(qkv, ByRows) else [qkv]
    assert parts and all(type(fn) in torch_paths for fn in parts)
    assert type(bf16.input_norm) is layers.RoundedRMSNorm
    monkeypatch.setenv("ITERSERVE_KERNELS", "flags")
    bf16 = ModelRunner("tiny-random", dtype="bfloat16").model.layers[0]
    # The rules: where bf16 is emulated, panels (with the kernels) or upcast slices (without).
    emulated = layers.PanelLinear if kernels.load() is not None else layers.UpcastLinear
    want = emulated if needs_upcast(torch.bfloat16) else layers.BucketedLinear
    assert type(bf16.qkv) is want
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=upcast")
    bf16 = ModelRunner("tiny-random", dtype="bfloat16").model.layers[0]
    assert type(bf16.o) is layers.UpcastLinear
    if layers.packing_available():
        monkeypatch.setenv("ITERSERVE_PACK_WEIGHTS", "1")
        monkeypatch.setenv("ITERSERVE_KERNELS", "flags")
        assert type(ModelRunner("tiny-random").model.layers[0].o) is layers.PackedLinear
        monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=packed")
        assert type(ModelRunner("tiny-random").model.layers[0].o) is layers.PackedLinear
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=panels,attn=cpu")
    if kernels.load() is not None:
        fused = ModelRunner("tiny-random", dtype="bfloat16").model.layers[0]
        assert type(fused.down) is layers.PanelLinear
        assert type(fused.post_norm) is layers.FusedRMSNorm
        assert type(fused.act) is layers.FusedSiluMul
        with pytest.raises(ValueError, match="gemm=panels, which cannot run here"):
            ModelRunner("tiny-random")  # f32: no panels


def test_engine_args_choose_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """--attention-backend (EngineArgs) reaches the runner and wins over the environment."""
    from iterserve.config import EngineArgs
    from iterserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv(ab.ENV, "cpu")
    engine = LLMEngine(EngineArgs(attention_backend="torch", num_kv_blocks=16))
    assert engine.runner.attention.name == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="sdpa")
