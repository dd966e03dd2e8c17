"""Model side against transformers: every family, through the paged cache, in mixed batches."""

from __future__ import annotations

import copy
import functools
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from iterserve.config import CacheConfig
from iterserve.model.builtin import make_test_checkpoint, resolve_model
from iterserve.model.layers import FusedRotary, HeadRMSNorm
from iterserve.model.model_config import ModelConfig
from iterserve.model.runner import BatchItem, ModelRunner

BLOCK = 4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # wavelengths of head_dim 16 straddle all 3 bands
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-sharded": ("llama", {"max_shard_size": "40KB"}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm-headdim": (
        "qwen3",
        {"head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
}

# Not in the parametrized runs: head_dim 64, what iterserve's bf16 prefill kernel takes.
EXTRA_CASES = {
    "llama-hd64": ("llama", {"head_dim": 64}),
    # q_size != hidden, and biases on every projection
    "llama-hd32-biases": ("llama", {"head_dim": 32, "attention_bias": True, "mlp_bias": True}),
}


class Case:
    def __init__(self, path: str):
        import transformers

        self.path = path
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        self.vocab = ModelConfig.from_pretrained(path).vocab_size

    def ref(self, ids: list[int]) -> torch.Tensor:
        """transformers' logits at every position."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0]

    def runner(self, **kw: Any) -> ModelRunner:
        kw.setdefault("cache_config", CacheConfig(block_size=BLOCK, num_kv_blocks=96))
        return ModelRunner(self.path, **kw)


@pytest.fixture(scope="session")
def case(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Case]:
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            arch, overrides = {**CASES, **EXTRA_CASES}[name]
            path = str(tmp_path_factory.mktemp(name))
            make_test_checkpoint(path, arch, seed=len(built), **overrides)
            built[name] = Case(path)
        return built[name]

    return get


def prompt(n: int, seed: int, vocab: int = 2048) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(n)]


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err < atol, f"max abs diff {err}"


@pytest.mark.parametrize("name", list(CASES))
def test_full_prompt_matches_transformers(case: Callable[[str], Case], name: str) -> None:
    c = case(name)
    ids = prompt(21, seed=1)
    out = c.runner().execute([BatchItem("a", ids, 0, [5, 0, 7, 2, 9, 11], True)])
    assert out.dtype == torch.float32 and out.shape == (1, c.vocab)
    close(out[0], c.ref(ids)[-1])


def test_greedy_execute_gives_the_logits_argmax(case: Callable[[str], Case]) -> None:
    """``execute(greedy=True)``: the argmax of the logits ``execute`` gives for the same items
    (float32 here: the LM head's two calls, the path every non-AMX model takes), int64, an
    empty step included; items asking for prompt logprobs are refused."""
    c = case("llama")
    runner = c.runner()
    ids = prompt(9, seed=3)
    items = [BatchItem("a", ids, 0, [5, 0, 7], True), BatchItem("b", ids[:4], 0, [1, 2], True)]
    logits = runner.execute(items)
    tokens = runner.execute(items, greedy=True)  # the same KV rows written again
    assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(-1))
    assert runner.execute([], greedy=True).shape == (0,)
    with pytest.raises(ValueError, match="prompt_targets"):
        runner.execute([BatchItem("a", ids, 0, [5, 0, 7], True, ids[1:])], greedy=True)


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_prefill_through_paged_cache(case: Callable[[str], Case], name: str) -> None:
    c = case(name)
    ids = prompt(23, seed=2)
    ref = c.ref(ids)
    runner = c.runner()
    table = [41, 3, 77, 12, 60, 8]  # non-contiguous, out of order
    pos = 0
    for n in (3, 5, 1, 6, 1, 7):  # chunk ends land mid-block and on block edges
        out = runner.execute([BatchItem("a", ids[pos : pos + n], pos, table, True)])
        pos += n
        close(out[0], ref[pos - 1])
    assert pos == len(ids)


@pytest.mark.parametrize("name", ["llama", "mistral-sliding-window", "qwen3-qknorm-headdim"])
def test_mixed_batch_equals_each_alone(case: Callable[[str], Case], name: str) -> None:
    c = case(name)
    runner = c.runner()
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate((19, 23, 9, 14, 6))]
    tables = [[1, 2, 3, 4, 5, 6], [20, 7, 30, 8, 40, 9], [50, 11, 51], [60, 13, 61, 14], [70, 71]]
    # Earlier steps: sequence 1 has its first 12 tokens cached; 2..4 all but their last token.
    runner.execute(
        [BatchItem("s1", prompts[1][:12], 0, tables[1], False)]
        + [BatchItem(f"s{i}", prompts[i][:-1], 0, tables[i], False) for i in (2, 3, 4)]
    )
    items = [
        BatchItem("d3", prompts[3][-1:], len(prompts[3]) - 1, tables[3], True),
        BatchItem("p0", prompts[0][:10], 0, tables[0], True),  # first chunk of a prompt
        BatchItem("d2", prompts[2][-1:], len(prompts[2]) - 1, tables[2], True),
        BatchItem("p1", prompts[1][12:], 12, tables[1], True),  # second chunk
        BatchItem("d4", prompts[4][-1:], len(prompts[4]) - 1, tables[4], False),
    ]
    out = runner.execute(items)
    assert out.shape == (4, c.vocab)  # rows follow item order, need_logits items only
    close(out[0], c.ref(prompts[3])[-1])
    close(out[1], c.ref(prompts[0])[9])
    close(out[2], c.ref(prompts[2])[-1])
    close(out[3], c.ref(prompts[1])[-1])
    # The non-logits decode still wrote its KV: its next decode must be right.
    nxt = prompts[4] + [7]
    out = runner.execute([BatchItem("d4", [7], len(prompts[4]), tables[4], True)])
    close(out[0], c.ref(nxt)[-1])


def test_shared_prefix_blocks_written_in_same_step(case: Callable[[str], Case]) -> None:
    """A reads B's prefix blocks that B fills in this very step (writes precede reads)."""
    c = case("llama")
    ids = prompt(14, seed=3)
    shared = [9, 4]  # positions 0..7
    out = c.runner().execute(
        [
            BatchItem("b", ids[:8], 0, shared, False),
            BatchItem("a", ids[8:], 8, shared + [15, 6], True),
        ]
    )
    close(out[0], c.ref(ids)[-1])


def test_no_logits_and_empty_steps(case: Callable[[str], Case]) -> None:
    c = case("llama")
    runner = c.runner()
    assert runner.execute([]).shape == (0, c.vocab)
    assert runner.execute([BatchItem("a", [5, 6], 0, [0], False)]).shape == (0, c.vocab)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_is_close(case: Callable[[str], Case], dtype: str) -> None:
    c = case("qwen3-qknorm-headdim")
    ids = prompt(20, seed=4)
    ref = c.ref(ids)
    runner = c.runner(dtype=dtype)
    # 16+ rows take the upcast GEMM path on CPUs without native bf16/fp16, fewer rows do not.
    runner.execute([BatchItem("a", ids[:17], 0, [3, 1, 4, 8, 5], False)])
    out = runner.execute([BatchItem("a", ids[17:], 17, [3, 1, 4, 8, 5], True)])
    assert out.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(out[0], ref[-1], dim=0).item()
    assert cos > 0.999, cos
    close(out[0], ref[-1], atol=0.1 * ref[-1].abs().max().item())


def test_runner_attributes_and_kv_sizing(case: Callable[[str], Case]) -> None:
    c = case("llama")
    cfg = ModelConfig.from_pretrained(c.path)
    # past the checkpoint's context: an error naming it, as vLLM's (it was cut silently)
    with pytest.raises(ValueError, match=f"max_position_embeddings {cfg.max_position_embeddings}"):
        c.runner(max_model_len=100_000)
    runner = c.runner(cache_config=CacheConfig(block_size=8, kv_cache_memory=1 << 20))
    assert runner.kv_bytes_per_block == 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    assert runner.num_kv_blocks == (1 << 20) // runner.kv_bytes_per_block
    assert runner.max_model_len == cfg.max_position_embeddings  # unset: the checkpoint's
    assert runner.num_params == sum(p.numel() for p in c.hf.parameters()) == cfg.num_params
    assert runner.eos_token_ids == [2, 4] and runner.num_layers == 2
    assert runner.hf_config["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="holds no KV block"):
        c.runner(cache_config=CacheConfig(kv_cache_memory=1000))
    with pytest.raises(ValueError, match="block_table"):
        runner.execute([BatchItem("a", list(range(5, 14)), 0, [0], True)])
    with pytest.raises(ValueError, match="max_model_len"):
        c.runner(max_model_len=8).execute([BatchItem("a", list(range(5, 14)), 0, [0, 1, 2], True)])


# ---- errors ------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="lacks.*vocab_size"):
        ModelConfig.from_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "intermediate_size": 8,
            }
        )


def _cfg(arch: str, **extra: Any) -> ModelConfig:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    base |= {"intermediate_size": 64, "vocab_size": 100}
    return ModelConfig.from_dict({"architectures": [arch], **base, **extra})


def test_config_keys_left_out_take_transformers_defaults() -> None:
    """Where config.json leaves a key out, the value transformers' config class gives it
    (each was a silent mismatch against transformers or a misleading refusal)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    hf = {
        "LlamaForCausalLM": LlamaConfig,
        "MistralForCausalLM": MistralConfig,
        "Qwen2ForCausalLM": Qwen2Config,
        "Qwen3ForCausalLM": Qwen3Config,
    }
    for arch, cls in hf.items():
        ours, theirs = _cfg(arch), cls(hidden_size=64, num_attention_heads=4)
        assert ours.max_position_embeddings == theirs.max_position_embeddings, arch
        # Qwen2Config has no head_dim: its attention takes hidden / heads
        want = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
        assert ours.head_dim == want, arch
    assert _cfg("MistralForCausalLM").sliding_window == MistralConfig().sliding_window == 4096
    assert _cfg("MistralForCausalLM", sliding_window=None).sliding_window is None


def test_rope_scaling_replaces_rope_parameters_as_in_transformers() -> None:
    """transformers 5 writes rope_parameters; a rope_scaling added beside it (as model cards
    tell users to, for long context) replaces it, rope_theta included."""
    from transformers import Qwen3Config

    params = {"rope_type": "default", "rope_theta": 5e5}
    scaling = {"rope_type": "linear", "factor": 4.0}
    rope = _cfg("Qwen3ForCausalLM", rope_parameters=params, rope_scaling=scaling).rope
    theirs = Qwen3Config.from_dict({"rope_parameters": params, "rope_scaling": scaling})
    assert (rope.rope_type, rope.factor, rope.theta) == (
        theirs.rope_parameters["rope_type"],
        theirs.rope_parameters["factor"],
        theirs.rope_parameters["rope_theta"],
    )
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        _cfg(
            "Qwen3ForCausalLM",
            rope_parameters=params,
            rope_scaling={"rope_type": "yarn", "factor": 4.0},
        )


def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers() -> None:
    """transformers gives a config's top-level original_max_position_embeddings priority over
    the rope dict's (Phi-3 writes it there); read from the dict, llama3's frequencies and
    every greedy token differed (found by a review)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    scaling |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    extra = {"rope_scaling": scaling, "original_max_position_embeddings": 256}
    extra |= {"max_position_embeddings": 1024}
    rope = _cfg("LlamaForCausalLM", **extra).rope
    # the model built from the config reads it so (the config object alone still says 64)
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    small |= {"intermediate_size": 64, "vocab_size": 100}
    theirs = LlamaForCausalLM(LlamaConfig(**small, **copy.deepcopy(extra))).config
    assert theirs.rope_parameters["original_max_position_embeddings"] == 256
    assert rope.original_max_position_embeddings == 256
    del extra["original_max_position_embeddings"]
    assert _cfg("LlamaForCausalLM", **extra).rope.original_max_position_embeddings == 64


def test_qwen_sliding_layers_as_transformers_counts_them() -> None:
    """use_sliding_window without layer_types: transformers slides from max_window_layers
    on; every layer full is served, any sliding one refused."""
    ok = _cfg("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=2)
    assert ok.sliding_window is None
    with pytest.raises(ValueError, match="max_window_layers 1"):
        _cfg("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=1)


def test_quantized_checkpoints_are_refused_saying_so() -> None:
    """Their weights are refused when loaded; their shape (the simulator's use) is read."""
    from iterserve.model.model_config import check_not_quantized

    cfg = _cfg("Qwen3ForCausalLM", quantization_config={"quant_method": "fp8"})
    assert cfg.num_layers == 2
    with pytest.raises(ValueError, match=r"quantized checkpoints \(fp8\) are not supported"):
        check_not_quantized(cfg)


def test_a_tied_config_with_a_different_lm_head_is_refused(tmp_path: Any) -> None:
    """tie_word_embeddings with an lm_head.weight in the file: the same values tie; different
    ones are a clear error (transformers 5 would use them, transformers 4 tie)."""
    src = make_test_checkpoint(str(tmp_path / "src"), "qwen2", tie_word_embeddings=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    assert "lm_head.weight" not in state
    emb = state["model.embed_tokens.weight"]
    for name, head, ok in (("same", emb.clone(), True), ("other", emb.flip(0).clone(), False)):
        dst = tmp_path / name
        dst.mkdir()
        for f in os.listdir(src):
            if f != "model.safetensors":
                (dst / f).write_bytes(open(os.path.join(src, f), "rb").read())
        save_file({**state, "lm_head.weight": head}, str(dst / "model.safetensors"))
        if ok:
            ModelRunner(str(dst))
        else:
            with pytest.raises(ValueError, match="lm_head.weight differs"):
                ModelRunner(str(dst))


def test_missing_files(case: Callable[[str], Case], tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    with open(os.path.join(case("llama").path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        ModelRunner(str(tmp_path))


def test_missing_tensor(case: Callable[[str], Case], tmp_path: Any) -> None:
    src = case("llama").path
    for f in ("config.json", "generation_config.json"):
        with open(os.path.join(src, f)) as fh:
            (tmp_path / f).write_text(fh.read())
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        ModelRunner(str(tmp_path))


# ---- built-ins -----------------------------------------------------------------------------


def test_builtin_tiny_random_is_deterministic(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "a"))
    p1 = resolve_model("tiny-random")
    assert resolve_model("tiny-random") == p1 and p1.endswith("tiny-random-v1")
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "b"))
    p2 = resolve_model("tiny-random")
    w1, w2 = (
        load_file(os.path.join(p1, "model.safetensors")),
        load_file(os.path.join(p2, "model.safetensors")),
    )
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)

    tok = AutoTokenizer.from_pretrained(p1)
    cfg = ModelConfig.from_pretrained(p1)
    assert len(tok) == cfg.vocab_size and tok.eos_token_id in cfg.eos_token_ids
    text = "The quick brown fox jumps over the lazy dog. Ünïcode 🙂 too!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(tok.encode(" the water", add_special_tokens=False)) == 2  # common words: one token
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")

    runner = ModelRunner("tiny-random", cache_config=CacheConfig(num_kv_blocks=8))
    assert runner.model_path == p2  # built-in names resolve inside the runner too
    greedy = [
        runner.execute([BatchItem(str(i), ids[:k], 0, [0, 1, 2, 3], True)])[0].argmax().item()
        for i, k in enumerate((3, 5, 8))
    ]
    assert len(set(greedy)) > 1  # weights are not trivially flat


def test_unknown_builtin() -> None:
    with pytest.raises(ValueError, match="tiny-random.*local"):
        resolve_model("no-such-model")


@pytest.mark.parametrize("kern", ["gemm=torch,attn=torch", "gemm=packed,attn=cpu", "0", "flags"])
def test_packed_and_plain_weights_match_transformers(
    case: Callable[[str], Case], kern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both f32 GEMM paths (prepacked f32 oneDNN weights, plain F.linear) and both decode
    attention paths, fixed by ITERSERVE_KERNELS, give transformers' logits, for a decode batch
    and a prefill, with a bias (qwen2) and without."""
    from iterserve.model.layers import packing_available

    if "packed" in kern and not packing_available():
        pytest.skip("oneDNN packing is not in this torch build")
    monkeypatch.setenv("ITERSERVE_KERNELS", kern)
    monkeypatch.setenv("ITERSERVE_PACK_WEIGHTS", "1")
    for name in ("llama", "qwen2-bias"):
        c = case(name)
        runner = c.runner()
        if kern != "0":  # 0: torch's paths, measured
            assert runner.packed_weights == ("packed" in kern or kern == "flags")
        prompts = [prompt(9 + i, seed=40 + i) for i in range(10)]
        tables = [[8 * i + j for j in range(5)] for i in range(10)]
        runner.execute(
            [BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts)]
        )
        out = runner.execute(
            [BatchItem(f"s{i}", p[-1:], len(p) - 1, tables[i], True) for i, p in enumerate(prompts)]
        )
        for i, p in enumerate(prompts):
            close(out[i], c.ref(p)[-1])


def test_low_precision_paths_agree(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 through every GEMM path (torch's oneDNN, the sliced upcast, iterserve's panels, the
    packed f32 copy, the bf16 dot-product pairs and oneDNN's prepacked bf16 where the CPU has
    them;
    ITERSERVE_KERNELS=gemm=...) and both decode attention paths, with iterserve's kernels or
    torch's, and the fixed CPU-flag rules: the same logits up to bf16
    rounding of intermediate activations. Prefill (~150 rows) and decodes of 9 and 5."""
    from iterserve.model import kernels
    from iterserve.model.cpu import has_native, needs_upcast
    from iterserve.model.layers import packing_available

    c = case("llama")
    prompts = [prompt(12 + i, seed=50 + i) for i in range(9)]
    tables = [[6 * i + j for j in range(6)] for i in range(9)]
    outs = []
    monkeypatch.setenv("ITERSERVE_PACK_WEIGHTS", "1")
    settings = ["gemm=torch,attn=torch", "gemm=upcast,attn=cpu", "gemm=panels,attn=cpu", "0"]
    settings += ["gemm=packed,attn=torch"] if packing_available() else []
    k = kernels.load()
    settings += ["gemm=pairs,attn=cpu"] if k is not None and k.has_bf16_dot else []
    settings += ["gemm=amx,attn=cpu"] if k is not None and k.has_amx else []
    if has_native(torch.bfloat16) and packing_available():
        settings += ["gemm=onednn,attn=cpu"]
    for kern in [*settings, "flags"]:
        monkeypatch.setenv("ITERSERVE_KERNELS", kern)
        assert (kernels.load() is not None) == (kern != "0")
        runner = c.runner(dtype="bfloat16")
        assert runner.kv_caches[0][0].dtype == torch.bfloat16
        want_panels = "panels" in kern or (kern == "flags" and needs_upcast(torch.bfloat16))
        assert runner.panel_weights == want_panels
        assert runner.attention.name == ("torch" if kern == "0" else "cpu")
        runner.execute(
            [BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts)]
        )
        nine = runner.execute(
            [BatchItem(f"s{i}", p[-1:], len(p) - 1, tables[i], True) for i, p in enumerate(prompts)]
        )
        five = runner.execute(
            [
                BatchItem(f"s{i}", p[-1:], len(p) - 1, tables[i], True)
                for i, p in enumerate(prompts[:5])
            ]
        )
        outs.append(torch.cat([nine, five]))
    cos = torch.nn.functional.cosine_similarity
    for i, p in enumerate(prompts + prompts[:5]):
        ref = c.ref(p)[-1]
        for out in outs:
            assert cos(out[i], ref, dim=0).item() > 0.995  # bf16 against the f32 reference
        for out in outs[1:]:
            assert cos(outs[0][i], out[i], dim=0).item() > 0.9999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continued_chunk_mask_is_shifted_causal(dtype: torch.dtype) -> None:
    """A chunk of n tokens from position p0: query i sees keys 0 .. p0 + i, the rest -inf."""
    from iterserve.model import attention

    for n, p0 in [(2, 1), (5, 3), (16, 16), (33, 40)]:
        items = [attention.StepItem(n, p0, list(range(10)))]
        mask = attention.build_attention_metadata(items, 0, 16, None, dtype).prefills[0].mask
        allowed = torch.arange(p0 + n)[None, :] <= torch.arange(p0, p0 + n)[:, None]
        ref = torch.zeros(n, p0 + n).masked_fill_(~allowed, float("-inf"))
        assert mask is not None and torch.equal(mask.float(), ref)


def test_gemm_row_buckets_bound_shapes_and_keep_results() -> None:
    """oneDNN GEMMs run at few row counts (each one builds a primitive once): exact for decode
    batches, <= 1/16 extra rows above, 128 sizes up to 2048 rows; padding leaves the real rows'
    results unchanged, for the packed f32 path and the bf16 one."""
    from iterserve.model.layers import (
        EXACT_ROWS,
        BucketedLinear,
        PackedLinear,
        UpcastLinear,
        bucket_rows,
        packing_available,
    )

    sizes = [bucket_rows(m) for m in range(1, 2049)]
    assert sizes[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(b >= m and (b - m) * 16 <= m for m, b in enumerate(sizes, 1))
    assert sizes == sorted(sizes) and bucket_rows(512) == 512 and bucket_rows(2048) == 2048
    assert len(set(sizes)) == 128
    torch.manual_seed(0)
    w, b = torch.randn(40, 24), torch.randn(40)
    for m in (33, 100, 301):  # padded to 34, 104, 304
        x = torch.randn(m, 24)
        ref = torch.nn.functional.linear(x, w, b)
        if packing_available():
            torch.testing.assert_close(PackedLinear(w, b)(x), ref, rtol=1e-5, atol=1e-5)
        for strategy in (BucketedLinear, UpcastLinear):
            bf = strategy(w.bfloat16(), b.bfloat16())(x.bfloat16())
            assert bf.shape == (m, 40) and bf.dtype == torch.bfloat16
            torch.testing.assert_close(bf.float(), ref, rtol=0.05, atol=0.15)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
# 20: the scalar path (head_dim not a multiple of 16); 16 (AVX2), 64, 128: the bf16 fast path
@pytest.mark.parametrize("hd", [16, 20, 64, 128])
@pytest.mark.parametrize("variant", ["native", "avx2"])
def test_decode_kernel_matches_sdpa(cache_dtype: torch.dtype, hd: int, variant: str) -> None:
    """iterserve's paged decode kernel, fed by the step's metadata, equals SDPA over the gathered
    padded window: GQA, contexts of different lengths, scattered blocks, a sliding window; as
    built for this CPU and as built for AVX2 without AVX-512; the software prefetch (the
    cpu_nopf path's none, the cpu path's default, one past a 4-token block, into L1 or L2)
    changes no bit."""
    from iterserve.model import attention, kernels
    from tests.test_kernels import avx2_kernels

    kern = kernels.load() if variant == "native" else avx2_kernels()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    torch.manual_seed(0)
    bs, kvh, G, nblocks = 4, 2, 3, 40
    k_cache = torch.randn(nblocks * bs, kvh, hd).to(cache_dtype) * 2
    v_cache = torch.randn(nblocks * bs, kvh, hd).to(cache_dtype)
    positions = [0, 5, 13, 22, 15, 45]  # each decode's own position (its key is already written)
    items = [attention.StepItem(1, p, torch.randperm(nblocks)[:12].tolist()) for p in positions]
    for window in (None, 7):
        meta = attention.build_attention_metadata(items, len(items), bs, window, torch.float32)
        assert meta.decode_block_ids is not None and meta.decode_mask is not None
        assert meta.decode_ctx_lens is not None and meta.decode_starts is not None
        D = len(items)
        q = torch.randn(D, kvh * G, hd)
        tables = meta.decode_block_ids.view(D, -1)
        decode = functools.partial(
            kern.paged_decode_attention,
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=tables,
            ctx_lens=meta.decode_ctx_lens,
            starts=meta.decode_starts,
            block_size=bs,
        )
        out = decode(q)
        for prefetch in (0, 5):
            assert torch.equal(decode(q, prefetch=prefetch), out)
        for prefetch in (kernels.DECODE_PREFETCH, 5):
            assert torch.equal(decode(q, prefetch=prefetch, prefetch_l2=True), out)
        with pytest.raises(ValueError, match="prefetch must be >= 0"):
            decode(q, prefetch=-1)
        # bf16 queries with strided rows (as q sits in the layer's qk tensor): bf16 out
        qk = torch.randn(D, kvh * G + 1, hd).bfloat16()
        out16 = decode(qk[:, : kvh * G])
        assert out16.dtype == torch.bfloat16
        ref16 = decode(qk[:, : kvh * G].float())
        assert torch.equal(out16, ref16.bfloat16())
        ids = meta.decode_block_ids
        kd, vd = (
            c.view(-1, bs, kvh, hd)[ids].float().view(D, -1, kvh, hd).transpose(1, 2)
            for c in (k_cache, v_cache)
        )
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.view(D, kvh * G, 1, hd), kd, vd, attn_mask=meta.decode_mask, enable_gqa=True
        )
        close(out, ref.view(D, kvh * G, hd), atol=1e-5)


def _sdpa_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    ctx: int, start: int, bs: int,
) -> torch.Tensor:  # fmt: skip
    """SDPA of one decode query [H, hd] over its sequence's keys start .. ctx - 1."""
    kvh, hd = k_cache.shape[1:]
    kd, vd = (
        c.view(-1, bs, kvh, hd)[table].reshape(-1, kvh, hd)[start:ctx] for c in (k_cache, v_cache)
    )
    return torch.nn.functional.scaled_dot_product_attention(
        q.view(1, -1, 1, hd),
        kd.float().transpose(0, 1)[None],
        vd.float().transpose(0, 1)[None],
        enable_gqa=True,
    ).view(-1, hd)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["native", "avx2"])
def test_decode_kernel_splits_the_keys_where_threads_would_idle(
    cache_dtype: torch.dtype, variant: str
) -> None:
    """Where the sequences alone would leave threads idle (fewer sequences than threads, or a
    count the threads do not divide) the decode kernel splits each one's keys and merges the
    parts' softmaxes: 1-3 sequences equal SDPA over their windows on 1-4 threads, with GQA, a
    window starting mid-block, parts ending mid-block, and contexts too short to split (under
    32 keys a part: the heads are split)."""
    from iterserve.model import kernels
    from tests.test_kernels import avx2_kernels

    kern = kernels.load() if variant == "native" else avx2_kernels()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for hd, kvh, G, bs, ctx, start in (
            (64, 12, 1, 16, 128, 0),
            (64, 2, 3, 4, 150, 7),
            (128, 2, 2, 32, 65, 0),
            (64, 3, 2, 16, 63, 0),
            (64, 1, 4, 16, 300, 250),
        ):
            nblocks = ctx // bs + 8
            k_cache = (torch.randn(nblocks * bs, kvh, hd) * 2).to(cache_dtype)
            v_cache = torch.randn(nblocks * bs, kvh, hd).to(cache_dtype)
            for D in (1, 2, 3):
                tables = torch.stack([torch.randperm(nblocks)[: -(-ctx // bs)] for _ in range(D)])
                q = torch.randn(D, kvh * G, hd)
                ref = [
                    _sdpa_decode(q[d], k_cache, v_cache, tables[d], ctx, start, bs)
                    for d in range(D)
                ]
                for nt in (1, 2, 3, 4):
                    torch.set_num_threads(nt)
                    out = kern.paged_decode_attention(
                        q, k_cache, v_cache, tables, torch.tensor([ctx] * D),
                        torch.tensor([start] * D), bs,
                    )  # fmt: skip
                    close(out, torch.stack(ref), atol=1e-5)
        # a NaN query head gives NaN on any thread count (the merge once turned it into 0s)
        hd, kvh, bs, ctx = 64, 2, 16, 256
        k_cache = torch.randn(ctx, kvh, hd).to(cache_dtype)
        v_cache = torch.randn(ctx, kvh, hd).to(cache_dtype)
        tables = torch.arange(ctx // bs).view(1, -1)
        q = torch.randn(1, kvh, hd)
        q[0, 0, 3] = float("nan")
        for nt in (1, 2, 4):
            torch.set_num_threads(nt)
            args = (k_cache, v_cache, tables, torch.tensor([ctx]), torch.tensor([0]), bs)
            out = kern.paged_decode_attention(q, *args)
            assert bool(out[0, 0].isnan().all()) and not bool(out[0, 1].isnan().any()), nt
            # no sequences at all: an empty answer (the split's loop once never ended)
            none = kern.paged_decode_attention(q[:0], k_cache, v_cache, tables[:0],
                                               torch.tensor([], dtype=torch.int64),
                                               torch.tensor([], dtype=torch.int64), bs)  # fmt: skip
            assert none.shape == (0, kvh, hd)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["native", "avx2"])
def test_decode_kernel_splits_a_long_sequence_among_short_ones(
    cache_dtype: torch.dtype, variant: str
) -> None:
    """Where one sequence holds most of a step's keys, its keys split into parts (merged by
    their log-sum-exps) beside the short ones' whole or head-split tasks, and a short sequence
    no longer makes the others split their heads: every output equals SDPA over its own window
    on 1-4 threads."""
    from iterserve.model import kernels
    from tests.test_kernels import avx2_kernels

    kern = kernels.load() if variant == "native" else avx2_kernels()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    hd, kvh, G, bs = 64, 2, 3, 16
    try:
        for seqs in (
            [(1000, 0), (40, 0)],
            [(600, 0), (20, 0), (150, 5), (17, 0)],
            [(300, 250), (2000, 0), (64, 0)],
            [(700, 0)] + [(30, 0)] * 5,
            [(900, 0), (850, 3), (5, 0)],
        ):
            per = -(-max(c for c, _ in seqs) // bs)
            nblocks = per * len(seqs) + 4
            k_cache = (torch.randn(nblocks * bs, kvh, hd) * 2).to(cache_dtype)
            v_cache = torch.randn(nblocks * bs, kvh, hd).to(cache_dtype)
            order = torch.randperm(nblocks)
            tables = torch.stack([order[d * per : (d + 1) * per] for d in range(len(seqs))])
            q = torch.randn(len(seqs), kvh * G, hd)
            ref = torch.stack(
                [
                    _sdpa_decode(q[d], k_cache, v_cache, tables[d], c, s, bs)
                    for d, (c, s) in enumerate(seqs)
                ]
            )
            lens = torch.tensor([c for c, _ in seqs])
            starts = torch.tensor([s for _, s in seqs])
            for nt in (1, 2, 3, 4):
                torch.set_num_threads(nt)
                out = kern.paged_decode_attention(q, k_cache, v_cache, tables, lens, starts, bs)
                close(out, ref, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def _plan_makespan(plan: list[tuple[int, int, int, int, int, int]], kvh: int, nt: int) -> float:
    """The longest a thread works when the plan's tasks go in its order, each to the thread
    with the least so far (keys times the share of the heads)."""
    load = [0.0] * nt
    for _, h0, h1, _, b, e in plan:
        load[load.index(min(load))] += (e - b) * (h1 - h0) / kvh
    return max(load)


def test_decode_plan_evens_the_threads_where_lengths_differ() -> None:
    """paged_decode_attention's plan: equal sequences a multiple of the threads keep one task
    each; fewer sequences, or an odd count, split each one's keys (or, too short, its heads:
    each sequence on its own); a long sequence among short ones splits its keys until the
    threads' shares are within 10% of even while the short ones keep whole tasks; the plan
    lists the longest tasks first."""
    from iterserve.model import kernels

    kern = kernels.load()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    plan = kern.decode_attention_plan
    assert plan([200] * 4, [0] * 4, 12, 16, 2) == [(d, 0, 12, -1, 0, 200) for d in range(4)]
    # parts end on whole blocks (16 keys), the longer first
    assert plan([100], [0], 12, 16, 2) == [(0, 0, 12, 1, 48, 100), (0, 0, 12, 0, 0, 48)]
    assert plan([50], [0], 12, 16, 2) == [(0, 0, 6, -1, 0, 50), (0, 6, 12, -1, 0, 50)]
    # one sequence of 1,000 keys beside one of 40: the long one in two parts, the short one whole
    p = plan([1000, 40], [0, 0], 12, 16, 2)
    assert sorted(p) == [(0, 0, 12, 0, 0, 496), (0, 0, 12, 1, 496, 1000), (1, 0, 12, -1, 0, 40)]
    assert p[-1][0] == 1  # the short task last
    # 3 equal sequences on 2 threads: each in two parts
    p = plan([1000] * 3, [0] * 3, 12, 16, 2)
    assert sorted(t[0] for t in p) == [0, 0, 1, 1, 2, 2] and all(t[3] >= 0 for t in p)
    # short sequences split their heads, the long one beside them its keys (a short one once
    # made every sequence split its heads)
    p = plan([300, 20, 20], [0] * 3, 12, 16, 2)
    assert sorted(p) == [
        (0, 0, 12, 0, 0, 144), (0, 0, 12, 1, 144, 300),
        *((d, h, h + 6, -1, 0, 20) for d in (1, 2) for h in (0, 6)),
    ]  # fmt: skip
    # three sequences too short for key parts on 2 threads: they split their heads
    p = plan([40] * 3, [0] * 3, 12, 16, 2)
    assert sorted(p) == [(d, h, h + 6, -1, 0, 40) for d in range(3) for h in (0, 6)]
    # ... and beside a long one, only they do (the long one's keys split)
    p = plan([1000, 40, 1000], [0] * 3, 12, 16, 2)
    assert {t[1:3] for t in p if t[0] == 1} == {(0, 6), (6, 12)}
    assert all(t[1:4] == (0, 12, t[3]) and t[3] >= 0 for t in p if t[0] != 1)
    # one long sequence among 7 short ones on 4 threads: within 10% of an even share
    lens = [4000] + [100] * 7
    p = plan(lens, [0] * 8, 8, 16, 4)
    assert _plan_makespan(p, 8, 4) <= 1.1 * sum(lens) / 4
    assert sum(1 for t in p if t[0] == 0) > 1 and all(t[3] == -1 for t in p if t[0] > 0)
    work = [(e - b) * (h1 - h0) for _, h0, h1, _, b, e in p]
    assert work == sorted(work, reverse=True)


@settings(max_examples=300, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), max_size=10),
    kvh=st.sampled_from([1, 2, 3, 8, 12]),
    bs=st.sampled_from([1, 4, 16, 32]),
    nt=st.integers(1, 8),
)
def test_property_decode_plan_covers_every_key_once(
    seqs: list[tuple[int, int]], kvh: int, bs: int, nt: int
) -> None:
    """Any lengths, windows, head counts, block sizes and thread counts: each sequence's
    (head, key) pairs are covered exactly once, by whole-key tasks over head ranges or by
    all-head parts of at least 32 keys with slots of their own, and the tasks come longest
    first."""
    from iterserve.model import kernels

    kern = kernels.load()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    lens = [max(a, b) for a, b in seqs]
    starts = [min(a, b) for a, b in seqs]
    plan = kern.decode_attention_plan(lens, starts, kvh, bs, nt)
    slots = [t[3] for t in plan if t[3] >= 0]
    assert sorted(slots) == list(range(len(slots)))
    for d in {t[0] for t in plan if t[3] >= 0}:  # the merge reads a sequence's parts in a row
        mine = sorted((t[4], t[3]) for t in plan if t[0] == d)
        assert [s for _, s in mine] == list(range(mine[0][1], mine[0][1] + len(mine)))
    for d, (ctx, start) in enumerate(zip(lens, starts, strict=True)):
        mine = [t for t in plan if t[0] == d]
        if any(t[3] >= 0 for t in mine):  # key parts: all heads, contiguous, >= 32 keys each
            assert len(mine) >= 2 and all(t[3] >= 0 and t[1:3] == (0, kvh) for t in mine)
            bounds = sorted(t[4:] for t in mine)
            assert bounds[0][0] == start and bounds[-1][1] == ctx
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            # (a part's bounds fall back to whole blocks: up to a block short)
            assert all(e - b > min(32, (ctx - start) // len(mine)) - bs for b, e in bounds)
        else:  # head ranges over every key
            assert all(t[4:] == (start, ctx) for t in mine)
            heads = sorted(t[1:3] for t in mine)
            assert heads[0][0] == 0 and heads[-1][1] == kvh
            assert all(a[1] == b[0] < b[1] for a, b in zip(heads, heads[1:], strict=False))
    work = [(e - b) * (h1 - h0) for _, h0, h1, _, b, e in plan]
    assert work == sorted(work, reverse=True)


@pytest.mark.parametrize("window", [None, 3])
def test_decode_mask_is_built_when_read_on_the_metadatas_device(window: int | None) -> None:
    """The SDPA decode mask is not built with the step's metadata (the kernel decodes never read
    it); read, it hides each decode's keys outside [max(pos + 1 - window, 0), pos], padding
    included, in the dtype attention computes in, on the device the metadata was moved to (the
    torch backend on a GPU moves it: the 'meta' device stands in for one here)."""
    from iterserve.model import attention
    from iterserve.model.attention_backends import _to_device

    bs, positions = 4, [0, 5, 13]
    items = [
        attention.StepItem(1, p, list(range(10 * i, 10 * i + 10))) for i, p in enumerate(positions)
    ]
    meta = attention.build_attention_metadata(items, len(items), bs, window, torch.bfloat16)
    assert meta._decode_mask is None
    mask = meta.decode_mask
    assert mask is not None and meta.decode_mask is mask  # built once
    keys = (max(positions) // bs + 1) * bs
    assert mask.shape == (len(items), 1, 1, keys) and mask.dtype == meta.mask_dtype
    key_pos = torch.arange(keys)
    for d, p in enumerate(positions):
        seen = key_pos <= p
        if window is not None:
            seen &= key_pos > p - window
        assert torch.equal(mask[d, 0, 0] == 0, seen) and bool((mask[d, 0, 0][~seen] < 0).all())
    moved = _to_device(meta, torch.device("meta"))
    assert moved.decode_ctx_lens is not None and moved.decode_mask is not None
    assert moved.decode_mask.device.type == "meta" and moved.decode_mask.shape == mask.shape


@pytest.mark.parametrize("variant", ["native", "avx2"])
def test_grouped_query_decode_takes_each_query_heads_own_arithmetic(variant: str) -> None:
    """The bf16 decode kernel gives a query head sharing its KV head with others the same bits
    as with a KV head of its own (the cache's heads repeated per query head): grouped-query
    attention takes each query head's own arithmetic, whatever the grouping (a rewrite that
    batches a group's heads must keep it). Head sizes 32-256, 2-8 query heads a KV head,
    blocks of 4, 16 and 32, windows that start mid-block."""
    from iterserve.model import kernels
    from tests.test_kernels import avx2_kernels

    kern = kernels.load() if variant == "native" else avx2_kernels()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    torch.manual_seed(0)
    for hd, kvh, G, bs in (
        (64, 2, 4, 16),
        (128, 2, 3, 32),
        (32, 1, 8, 4),
        (256, 1, 2, 16),
        (64, 3, 5, 16),
    ):
        nblocks, D = 48, 5
        k_cache = torch.randn(nblocks * bs, kvh, hd).bfloat16()
        v_cache = torch.randn(nblocks * bs, kvh, hd).bfloat16()
        max_blocks = 70 // bs + 1
        tables = torch.stack([torch.randperm(nblocks)[:max_blocks] for _ in range(D)])
        ctx = torch.tensor([1, 16, 17, 45, 70])
        starts = torch.tensor([0, 0, 3, 21, 9])
        q = torch.randn(D, kvh * G, hd).bfloat16()
        shared = kern.paged_decode_attention(q, k_cache, v_cache, tables, ctx, starts, bs)
        own = kern.paged_decode_attention(
            q,
            k_cache.repeat_interleave(G, dim=1).contiguous(),
            v_cache.repeat_interleave(G, dim=1).contiguous(),
            tables, ctx, starts, bs,
        )  # fmt: skip
        assert torch.equal(shared, own), (hd, kvh, G, bs)


def test_pack_weights_setting_is_checked(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ITERSERVE_PACK_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="ITERSERVE_PACK_WEIGHTS must be 0, 1 or auto"):
        case("llama").runner()


def test_allocator_is_tuned_on_glibc() -> None:
    import platform

    from iterserve.model.cpu import trim_heap, tune_allocator

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert tune_allocator() is True and trim_heap() is True
    else:
        assert tune_allocator() in (True, False) and trim_heap() in (True, False)


def _vma_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``addr``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside:
                k, _, v = line.partition(":")
                fields[k] = v.strip()
    return fields


@pytest.mark.parametrize("wanted", ["1", "0"])
def test_kv_cache_and_packed_weights_on_huge_pages(
    wanted: str, monkeypatch: pytest.MonkeyPatch, case: Callable[[str], Case]
) -> None:
    """The CPU runner's KV cache and the packed bf16 weights come zeroed from empty_hugepages:
    a mapping of their own, starting on a 2 MiB boundary, marked for transparent huge pages
    where Linux offers them (THP not 'never'); ITERSERVE_HUGEPAGES=0 gives plain torch memory,
    and a bad value is refused."""
    import os
    import platform

    from iterserve.model.cpu import empty_hugepages

    monkeypatch.setenv("ITERSERVE_HUGEPAGES", wanted)
    t = empty_hugepages((3000, 4, 256), torch.bfloat16)  # 6 MB
    assert t.shape == (3000, 4, 256) and t.dtype == torch.bfloat16 and not t.any()
    # torch's own allocations are resizable storages; a tensor over a mapping is not
    own_mapping = platform.system() == "Linux"
    assert t.untyped_storage().resizable() is not (own_mapping and wanted == "1")
    if own_mapping and wanted == "1":
        assert t.data_ptr() % (2 << 20) == 0
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if wanted == "1" and own_mapping and os.path.exists(thp):
        if "[never]" not in open(thp).read():
            flags = _vma_flags(t.data_ptr() + (3 << 20))
            assert flags.get("THPeligible") == "1", sorted(flags.items())
    t.fill_(1.0)  # the mapping is writable and stays alive with the tensor
    assert float(t.float().sum()) == t.numel()
    runner = case("llama").runner()
    if runner.device.type == "cpu":
        k, v = runner.kv_caches[0]
        assert not k.any() and not v.any()
    from iterserve.model import kernels

    kern = kernels.load()
    if kern is not None and own_mapping:
        w = torch.randn(1024, 1024).bfloat16()  # 2 MiB of panels
        for packed in (kern.pack_panels(w), *([kern.pack_pairs(w)] if kern.has_bf16_dot else [])):
            assert (packed.data_ptr() % (2 << 20) == 0) is (wanted == "1")
    assert empty_hugepages((4,), torch.float32).untyped_storage().resizable()  # under 2 MiB
    monkeypatch.setenv("ITERSERVE_HUGEPAGES", "yes")
    with pytest.raises(ValueError, match="ITERSERVE_HUGEPAGES must be 0 or 1"):
        empty_hugepages((4,), torch.float32)


def test_bf16_prefill_kernel_through_the_runner(case: Callable[[str], Case]) -> None:
    """bf16 prefill, in one step and in chunks continued from the cache, through iterserve's
    prefill kernel where this CPU has it (else SDPA, which the same assertions then cover):
    close to transformers' f32 logits, and to the same runner's SDPA prefill."""
    from iterserve.model import attention, kernels
    from iterserve.model.attention_backends import CpuBackend

    c = case("llama-hd64")
    runner = c.runner(dtype="bfloat16")
    kern = kernels.load()
    assert kern is not None
    assert isinstance(runner.attention, CpuBackend)
    assert runner.attention.prefill_kernel == kern.has_prefill_kernel
    ids = prompt(150, seed=9)
    ref = c.ref(ids)[-1]
    one_table, chunk_table = list(range(38)), list(range(40, 78))

    def run() -> torch.Tensor:
        one = runner.execute([BatchItem("a", ids, 0, one_table, True)])[0]
        runner.execute([BatchItem("b", ids[:61], 0, chunk_table, False)])
        runner.execute([BatchItem("b", ids[61:128], 61, chunk_table, False)])
        chunked = runner.execute([BatchItem("b", ids[128:], 128, chunk_table, True)])[0]
        return torch.stack([one, chunked])

    outs = run()
    runner.attention.prefills = attention.prefill_chunks
    sdpa = run()
    cos = torch.nn.functional.cosine_similarity
    for i in range(2):
        assert cos(outs[i], ref, dim=0).item() > 0.995
        assert cos(outs[i], sdpa[i], dim=0).item() > 0.9999


def test_prefill_attention_choice_reaches_the_backend(
    case: Callable[[str], Case], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel choice's prefill path (here fixed by ITERSERVE_KERNELS, the rest measured) is
    what the cpu backend runs: SDPA for prefill=torch, the kernel for prefill=cpu, with the
    same greedy tokens."""
    from iterserve.model import kernels
    from iterserve.model.attention_backends import CpuBackend

    kern = kernels.load()
    assert kern is not None
    if not kern.has_prefill_kernel:
        pytest.skip("the prefill kernel is compiled in only with AVX512-BF16, or AVX2")
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    ids = prompt(70, seed=4)
    tokens = []
    for path in ("torch", "cpu"):
        monkeypatch.setenv("ITERSERVE_KERNELS", f"prefill={path}")
        runner = case("llama-hd64").runner(dtype="bfloat16")
        assert isinstance(runner.attention, CpuBackend)
        assert runner.kernel_choice is not None and runner.kernel_choice.prefill == (path,)
        assert runner.attention.prefill_kernel == (path == "cpu")
        logits = runner.execute([BatchItem("a", ids, 0, list(range(18)), True)])
        tokens.append(int(logits[0].argmax()))
    assert tokens[0] == tokens[1]


def _needs_gemm(gemm: str) -> None:
    from iterserve.model import kernels

    k = kernels.load()
    assert k is not None, "the C++ kernels did not build (see the warning logged)"
    if gemm == "pairs" and not k.has_bf16_dot:
        pytest.skip("the pair GEMM is compiled in only where the CPU has AVX512-BF16")
    if gemm == "amx" and not k.has_amx:
        pytest.skip("the AMX GEMM is compiled in only where the CPU has AMX-BF16 tiles")


FUSED_CASES = [
    "llama",
    "llama-tied",
    "llama-hd64",
    "llama-hd32-biases",
    "mistral-sliding-window",
    "qwen2-bias",
    "qwen3-qknorm-headdim",
]


@pytest.mark.parametrize("name", FUSED_CASES)
@pytest.mark.parametrize("gemm", ["pairs", "panels", "amx"])
def test_fused_decode_layers_give_the_same_bits(
    case: Callable[[str], Case], name: str, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 decode-only steps through one C++ call per layer (fused_decode.py) against the same
    steps through DecoderLayer.forward: identical logits and KV caches, step after step, at 1
    to 25 decodes (the pair GEMM's prefetching tiles start at 12 rows; head_dim 64 takes the
    vector decode task and RoPE), on the pair GEMM (dot products or AMX tiles) and on the
    f32-panel one; a step with a prefill in it takes the per-layer path. A model with a
    per-head q/k norm (Qwen3) takes the fused call too, the norm inside its RoPE. The decode
    kernel's prefetch (each kernel path in turn across the cases) reaches the fused call too,
    as paged_decode_attention's ``ahead``."""
    from iterserve.model import kernels

    _needs_gemm(gemm)
    attn = ("cpu", "cpu_l2", "cpu_nopf")[(FUSED_CASES.index(name) + len(gemm)) % 3]
    want_ahead = {"cpu": kernels.DECODE_PREFETCH, "cpu_l2": -kernels.DECODE_PREFETCH}.get(attn, 0)
    # every path fixed (prefill too), so the two runners cannot measure different choices
    monkeypatch.setenv("ITERSERVE_KERNELS", f"gemm={gemm},attn={attn},prefill=torch")
    c = case(name)
    cc = CacheConfig(block_size=BLOCK, num_kv_blocks=26 * 16)
    fused, plain = (c.runner(dtype="bfloat16", cache_config=cc) for _ in range(2))
    fd = fused.model.fused_decode
    assert fd is not None
    plain.model.fused_decode = None
    plan9 = fd.plan(9)
    assert plan9 is not None
    assert fd._prefetch[9] == want_ahead
    # Qwen3's q / k norm weight reaches decode_layer; no other family has one
    qk_norm = name.startswith("qwen3")
    assert all(bool(w.qk_norm) == qk_norm for w in plan9)
    ran = []
    run = fd.run
    fd.run = lambda *a: _record(ran, run(*a))  # type: ignore[method-assign]
    prompts = [prompt(12 + (3 * i) % 20, seed=70 + i) for i in range(26)]
    tables = [[16 * i + j for j in range(16)] for i in range(26)]
    pos = [len(p) - 1 for p in prompts]

    kern = fused.kernels
    assert kern is not None
    fused_argmax = []
    argmax_fn = kern.gemm_argmax
    monkeypatch.setattr(
        kern, "gemm_argmax", lambda *a, **k: _record(fused_argmax, argmax_fn(*a, **k))
    )
    screened: list[bool] = []
    screen_fn = kern.gemm_screen_argmax
    monkeypatch.setattr(
        kern, "gemm_screen_argmax", lambda *a, **k: _record(screened, screen_fn(*a, **k))
    )

    def both(items: list[BatchItem]) -> None:
        a, b = fused.execute(items), plain.execute(items)
        assert torch.equal(a, b)
        # the greedy tokens (the LM head's argmax in a pair GEMM's epilogue: on AMX past 16
        # rows): the logits' argmax (the step again writes the same KV rows)
        assert torch.equal(fused.execute(items, greedy=True), a.argmax(-1))

    both([BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts[:25])])
    counts = (9, 9, 1, 5, 13, 25)  # decode-only steps
    for n in counts:
        both([BatchItem(f"s{i}", [prompts[i][-1]], pos[i], tables[i], True) for i in range(n)])
        for i in range(n):
            pos[i] += 1
    # the pair GEMMs' epilogue (on AMX from 17 rows: the 25-row steps)
    assert bool(fused_argmax) == (gemm != "panels")
    # the 1-row step's LM head on its int8 screen, on the dot-product pair GEMM (no LM head
    # bias in these families)
    assert any(screened) == (gemm == "pairs" and kern.has_lm_screen)
    # gate_up and SwiGLU in one call on the pair GEMM where gate_up is in GLU_BLOCK's layout
    # (an intermediate size that is a multiple of 32): on AMX from 17 rows, on dot products at
    # any count (GateUpAct's rule); the layout needs bf16 dot products, whichever GEMM is forced
    glu = fused.model.layers[0].act.block > 0
    assert glu == (kern.has_bf16_dot and fused.model.layers[0].intermediate % 32 == 0)
    want = {9: int(glu and gemm == "pairs"), 25: int(glu and gemm != "panels")}
    for n, on in want.items():
        assert [w.amx >> 4 & 1 for w in fd.plan(n) or []] == [on] * len(plan9)
    # 5 decodes beside a new prompt's prefill: not decode-only
    both(
        [BatchItem(f"s{i}", [prompts[i][-1]], pos[i], tables[i], True) for i in range(5)]
        + [BatchItem("s25", prompts[25], 0, tables[25], True)]
    )
    for (ka, va), (kb, vb) in zip(fused.kv_caches, plain.kv_caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # each step twice: logits, then greedy tokens
    assert ran == [r for r in [False, *[True] * len(counts), False] for _ in range(2)]


def test_qwen3_qk_norm_in_the_rope_kernel_matches_torchs_ops(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3's per-head q/k norm inside RoPE's kernel call (and the other row-wise kernels)
    against torch's ops for all of them (ITERSERVE_KERNELS=0), the GEMMs and attention on
    torch in both: the same logits within bf16 rounding, prefill and decode steps alike (the
    norms' f32 sums of squares add in another order than torch's: rare last-place
    differences, test_kernels.py); and the same bits as the RMSNorm kernel per head followed by
    RoPE in separate calls."""
    c = case("qwen3-qknorm-headdim")
    runners = []
    for setting in ("gemm=torch,attn=torch,prefill=torch",) * 2 + ("0",):
        monkeypatch.setenv("ITERSERVE_KERNELS", setting)
        runners.append(c.runner(dtype="bfloat16"))
    fused, per_head, plain = runners
    assert isinstance(fused.model.layers[0].rotary, FusedRotary)
    assert fused.model.layers[0].rotary.norm is not None
    assert isinstance(plain.model.layers[0].qk_norm, HeadRMSNorm)
    # the same arithmetic in separate calls: the RMSNorm kernel per head, then RoPE alone
    kern = per_head.kernels
    assert kern is not None
    for layer in per_head.model.layers:
        norm = layer.rotary.norm
        assert norm is not None

        def heads(x: torch.Tensor, w: torch.Tensor = norm.weight, eps: float = norm.eps) -> Any:
            rows = [kern.rms_norm(x[:, i].contiguous(), w[i], eps) for i in range(x.shape[1])]
            return torch.stack(rows, 1)

        layer.qk_norm, layer.rotary = heads, FusedRotary(kern)
    per_head.model.fused_decode = None
    ids = [prompt(20 + 7 * i, seed=90 + i) for i in range(3)]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(3)]
    items = [BatchItem(f"s{i}", p, 0, tables[i], True) for i, p in enumerate(ids)]
    for _ in range(3):
        a, b = fused.execute(items), plain.execute(items)
        assert torch.equal(a, per_head.execute(items))
        assert (a - b).abs().max() <= 0.02 * b.abs().max()
        nxt = a.argmax(-1).tolist()
        items = [
            BatchItem(it.request_id, [t], it.start_pos + len(it.token_ids), it.block_table, True)
            for it, t in zip(items, nxt)
        ]


def _fused_and_plain(
    c: Case, gemm: str, cc: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Any]:
    """Two bf16 runners of ``c`` on GEMM ``gemm`` (the kernels' attention, torch's prefill):
    one with the one-call decode path, one without; and the first's FusedDecode."""
    _needs_gemm(gemm)
    monkeypatch.setenv("ITERSERVE_KERNELS", f"gemm={gemm},attn=cpu,prefill=torch")
    fused, plain = (c.runner(dtype="bfloat16", cache_config=cc) for _ in range(2))
    fd = fused.model.fused_decode
    assert fd is not None
    plain.model.fused_decode = None
    return fused, plain, fd


@pytest.mark.parametrize("gemm", ["pairs", "amx"])
def test_fused_decode_takes_the_swiglu_epilogue_where_gate_up_act_does(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch, gemm: str
) -> None:
    """decode_layer's gate_up runs SwiGLU in the pair GEMM's epilogue (dot products or AMX)
    exactly where the layer's GateUpAct would (its measured rule, autotune.epilogue_rule): with
    the rule saying no, the plan leaves it out and the step's logits stay those of the per-layer
    path."""
    c = case("llama")
    cc = CacheConfig(block_size=BLOCK, num_kv_blocks=26 * 16)
    fused, plain, fd = _fused_and_plain(c, gemm, cc, monkeypatch)
    assert all(w.amx >> 4 & 1 for w in fd.plan(25) or [None])
    for r in (fused, plain):
        for layer in r.model.layers:
            layer.gate_up_act.epilogue = lambda rows: rows > 25
    fd._plans.clear()
    plan = fd.plan(25)
    assert plan is not None and not any(w.amx >> 4 & 1 for w in plan)
    prompts = [prompt(10 + i, seed=40 + i) for i in range(25)]
    tables = [[16 * i + j for j in range(16)] for i in range(25)]
    items = [BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts)]
    assert torch.equal(fused.execute(items), plain.execute(items))
    ran: list[bool] = []
    run = fd.run
    fd.run = lambda *a: _record(ran, run(*a))  # type: ignore[method-assign]
    items = [
        BatchItem(f"s{i}", [p[-1]], len(p) - 1, tables[i], True) for i, p in enumerate(prompts)
    ]
    assert torch.equal(fused.execute(items), plain.execute(items))
    assert ran == [True]
    # ITERSERVE_KERNELS' glu= reaches the same rule
    monkeypatch.setenv("ITERSERVE_KERNELS", f"gemm={gemm},attn=cpu,prefill=torch,glu=separate")
    fd = c.runner(dtype="bfloat16", cache_config=cc).model.fused_decode
    assert fd is not None and not any(w.amx >> 4 & 1 for w in fd.plan(25) or [None])


@pytest.mark.parametrize(
    ("to_pairs", "mask"), [(("o", "down"), 0b0101), (("qkv", "gate_up"), 0b11010)]
)
def test_fused_decode_mixes_the_pair_gemms_per_projection(
    case: Callable[[str], Case],
    monkeypatch: pytest.MonkeyPatch,
    to_pairs: tuple[str, str],
    mask: int,
) -> None:
    """A layer whose o and down (or qkv and gate_up) GEMMs run the dot-product pair GEMM and
    whose other two run the same packed weights on AMX tiles (a measured choice can mix them at
    a row count): one call per layer still, telling each GEMM which kernel; gate_up on the
    dot-product GEMM takes SwiGLU in its epilogue at 7 rows (bit 4 without bit 2); the same
    bits as the per-layer path."""
    from iterserve.model.layers import AmxLinear, PairLinear

    _needs_gemm("amx")
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=amx,attn=cpu,prefill=torch")
    c = case("llama-hd32-biases")
    cc = CacheConfig(block_size=BLOCK, num_kv_blocks=8 * 16)
    fused, plain = (c.runner(dtype="bfloat16", cache_config=cc) for _ in range(2))
    for r in (fused, plain):
        for layer in r.model.layers:
            for n in to_pairs:
                lin = getattr(layer, n)
                assert type(lin) is AmxLinear
                pair = copy.copy(lin)  # the same packed weight and bias, the dot-product kernel
                pair.__class__ = PairLinear
                setattr(layer, n, pair)
                if n == "gate_up":
                    layer.gate_up_act.gate_up = pair
    fd = fused.model.fused_decode
    assert fd is not None and all(w.amx == mask for w in fd.plan(7) or [None])  # type: ignore[union-attr]
    plain.model.fused_decode = None
    prompts = [prompt(10 + i, seed=90 + i) for i in range(7)]
    tables = [[16 * i + j for j in range(16)] for i in range(7)]
    for r in (fused, plain):
        r.execute([BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts)])
    step = [BatchItem(f"s{i}", p[-1:], len(p) - 1, tables[i], True) for i, p in enumerate(prompts)]
    assert torch.equal(fused.execute(step), plain.execute(step))


def _record(ran: list[bool], out: Any) -> Any:
    ran.append(out is not None)
    return out


def test_fused_decode_needs_every_piece_on_the_kernels(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No plan where a layer's GEMM for the row count is neither the pair GEMM nor the panel
    one, or where decode attention goes through SDPA; no fused path at all without iterserve's
    kernels."""
    _needs_gemm("panels")
    c = case("llama")
    for setting in ("gemm=torch,attn=cpu", "gemm=panels,attn=torch"):
        monkeypatch.setenv("ITERSERVE_KERNELS", setting)
        fd = c.runner(dtype="bfloat16").model.fused_decode
        assert fd is not None and fd.plan(1) is None and fd.plan(9) is None, setting
    monkeypatch.setenv("ITERSERVE_KERNELS", "0")
    assert c.runner(dtype="bfloat16").model.fused_decode is None
    monkeypatch.setenv("ITERSERVE_KERNELS", "1")
    assert c.runner(dtype="float32").model.fused_decode is None  # bf16 kernels only


def test_fused_decode_follows_the_row_routing(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A layer whose o GEMM is the panel GEMM only up to 4 rows: plans up to 4 decodes, none
    above; a model without layers decodes through the (empty) per-layer loop."""
    from iterserve.model.autotune import ByRows
    from iterserve.model.layers import PanelLinear

    _needs_gemm("panels")
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=panels,attn=cpu")
    runner = case("llama").runner(dtype="bfloat16")
    fd = runner.model.fused_decode
    assert fd is not None
    layer = runner.model.layers[1]
    assert type(layer.o) is PanelLinear
    layer.o = ByRows([4, 1 << 30], [layer.o, lambda x: layer.o.table[0][1](x)])
    assert fd.plan(4) is not None and fd.plan(5) is None and fd.plan(1) is not None
    path = str(tmp_path / "no-layers")
    make_test_checkpoint(path, "llama", seed=3, num_hidden_layers=0)
    # measuring (GEMMs; attention fixed, so the decode path does not hang on a timing) times
    # the LM head alone: there is no layer 0
    for mode in ("flags", "attn=cpu"):
        monkeypatch.setenv("ITERSERVE_KERNELS", mode)
        monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / f"cache-{mode}"))
        empty = ModelRunner(path, dtype="bfloat16", cache_config=CacheConfig(BLOCK, 16))
        assert empty.model.fused_decode is not None and empty.model.fused_decode.plan(1) == []
        assert (empty.kernel_choice is None) == (mode == "flags")
        empty.execute([BatchItem("a", [5, 6, 7], 0, [0], False)])
        logits = empty.execute([BatchItem("a", [8], 3, [0, 1], True)])
        assert logits.shape == (1, empty.vocab_size) and torch.isfinite(logits).all()


def test_the_lm_head_screen_follows_iterserve_kernels(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model whose LM head runs on the dot-product pair GEMM takes the int8 screen for
    its greedy argmax (the same tokens as the logits' argmax), unless ITERSERVE_KERNELS says
    lmhead=full; a float32 model never does."""
    from iterserve.model import kernels
    from iterserve.model.layers import for_rows

    _needs_gemm("pairs")
    k = kernels.load()
    assert k is not None
    if not k.has_lm_screen:
        pytest.skip("the screen is compiled in only where the CPU has AVX512-BF16 and VNNI")
    cc = CacheConfig(block_size=BLOCK, num_kv_blocks=64)
    items = [BatchItem("a", prompt(20, seed=5), 0, list(range(8)), True)]
    ran: list[bool] = []
    screen_fn = k.gemm_screen_argmax
    monkeypatch.setattr(k, "gemm_screen_argmax", lambda *a: _record(ran, screen_fn(*a)))
    for form, want in (("screen", True), ("full", False)):
        monkeypatch.setenv("ITERSERVE_KERNELS", f"gemm=pairs,attn=cpu,prefill=torch,lmhead={form}")
        runner = case("llama").runner(dtype="bfloat16", cache_config=cc)
        head = for_rows(runner.model.lm_head, 1)
        assert head.kern is k and (getattr(head, "screen", None) is not None) == want, form
        ran.clear()
        logits = runner.execute(items)
        assert torch.equal(runner.execute(items, greedy=True), logits.argmax(-1))
        assert ran == ([True] if want else []), form
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=torch,attn=cpu,prefill=torch")
    runner = case("llama").runner(dtype="float32", cache_config=cc)
    assert getattr(for_rows(runner.model.lm_head, 1), "screen", None) is None


def test_the_12bit_weights_give_the_same_bits_and_follow_iterserve_kernels(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model whose GEMMs run on the dot-product pair GEMM reads their 12-bit copies at
    1 to 4 rows (PairLinear.__call__ and GateUpAct on the per-layer path, the plan's p12
    pointers on the fused one; the LM head's logits on both) and gets the logits and KV caches
    of the bf16 weights alone, bit for bit, step after step at 1 to 6 decodes; ITERSERVE_KERNELS'
    w12=off leaves them out, and a float32 model never has them."""
    from iterserve.model import kernels
    from iterserve.model.layers import for_rows

    _needs_gemm("pairs")
    k = kernels.load()
    assert k is not None
    if not k.has_pairs12:
        pytest.skip("compiled in only where the CPU has AVX512-BF16 and AVX512-BW")
    cc = CacheConfig(block_size=BLOCK, num_kv_blocks=8 * 16)
    runners = {}
    for form in ("on", "off"):
        monkeypatch.setenv("ITERSERVE_KERNELS", f"gemm=pairs,attn=cpu,prefill=torch,w12={form}")
        for path in ("fused", "plain"):
            r = case("llama-hd64").runner(dtype="bfloat16", cache_config=cc)
            if path == "plain":
                r.model.fused_decode = None
            runners[form, path] = r

    def p12_of(form: str, name: str, rows: int) -> Any:
        return for_rows(getattr(runners[form, "plain"].model.layers[0], name), rows).p12

    for name in ("qkv", "o", "gate_up", "down"):
        for m in (1, 4, 5):
            assert p12_of("on", name, m) is not None and p12_of("off", name, m) is None
    # the LM head's too (its logits; greedy steps take its screen)
    assert for_rows(runners["on", "plain"].model.lm_head, 1).p12 is not None
    assert for_rows(runners["off", "plain"].model.lm_head, 1).p12 is None

    def plan_p12(form: str, rows: int) -> list[bool]:
        fd = runners[form, "fused"].model.fused_decode
        plan = fd.plan(rows)
        assert plan is not None
        return [bool(w.p12[i]) for w in plan for i in range(4)]

    assert all(plan_p12("on", 1)) and all(plan_p12("on", 4))
    assert not any(plan_p12("on", 5)) and not any(plan_p12("off", 1))
    calls: list[bool] = []
    for fn_name in ("gemm_pairs12", "gemm_swiglu12"):
        orig = getattr(k, fn_name)
        monkeypatch.setattr(k, fn_name, lambda *a, _o=orig, **kw: _record(calls, _o(*a, **kw)))
    prompts = [prompt(9 + 2 * i, seed=80 + i) for i in range(6)]
    tables = [[16 * i + j for j in range(16)] for i in range(6)]
    for n in range(1, 7):
        pre = [BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts[:n])]
        step = [
            BatchItem(f"s{i}", [p[-1]], len(p) - 1, tables[i], True)
            for i, p in enumerate(prompts[:n])
        ]
        for r in runners.values():
            r.execute(pre)
        calls.clear()
        got = {key: r.execute(step) for key, r in runners.items()}
        # the per-layer path with 12-bit weights calls them at up to 4 rows (the fused one in C;
        # both for the LM head's logits)
        layer_calls = 4 * len(runners["on", "plain"].model.layers)
        assert calls == ([True] * (layer_calls + 2) if n <= 4 else [])
        want = got["off", "plain"]
        for key, logits in got.items():
            assert torch.equal(logits, want), (key, n)
        for key, r in runners.items():
            for (ka, va), (kb, vb) in zip(r.kv_caches, runners["off", "plain"].kv_caches):
                assert torch.equal(ka, kb) and torch.equal(va, vb), (key, n)
        # a greedy step's LM head takes its int8 screen, not its 12-bit copy (the same tokens)
        calls.clear()
        tokens = runners["on", "plain"].execute(step, greedy=True)
        assert torch.equal(tokens, want.argmax(-1))
        assert calls == ([True] * layer_calls if n <= 4 else [])
    # the fused step reads the copies themselves: one code changed, another qkv weight value
    qkv12 = for_rows(runners["on", "fused"].model.layers[0].qkv, 1).p12
    assert qkv12 is not None
    last = [BatchItem("s0", [prompts[0][-1]], len(prompts[0]) - 1, tables[0], True)]
    before = runners["on", "fused"].execute(last)
    with torch.inference_mode():  # the copies were made under it
        qkv12.blocks[128] ^= 1
        try:
            assert not torch.equal(runners["on", "fused"].execute(last), before)
        finally:
            qkv12.blocks[128] ^= 1
    assert torch.equal(runners["on", "fused"].execute(last), before)
    # a float32 model packs none
    packed: list[bool] = []
    pack_fn = k.pack_pairs12
    monkeypatch.setattr(k, "pack_pairs12", lambda *a: _record(packed, pack_fn(*a)))
    for dtype, kernel_setting in (("float32", "flags"), ("bfloat16", "gemm=pairs")):
        monkeypatch.setenv("ITERSERVE_KERNELS", kernel_setting)
        case("llama").runner(dtype=dtype, cache_config=cc)
        assert (packed == []) == (dtype == "float32") and all(packed)
    # nor where the copies would take more than half the free memory
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=pairs,attn=cpu,prefill=torch")
    model = case("llama").runner(dtype="bfloat16", cache_config=cc).model
    monkeypatch.setattr("iterserve.model.runner._available_memory", lambda: 4096)
    runner = case("llama").runner(dtype="bfloat16", cache_config=cc)
    assert for_rows(runner.model.layers[0].qkv, 1).p12 is None
    assert for_rows(runner.model.lm_head, 1).p12 is None
    # room for the layers' copies (3/8 of their f32 bytes) but not the LM head's as well: the
    # layers keep theirs
    layers12 = [
        getattr(layer, n).p12 for layer in model.layers for n in ("qkv", "o", "gate_up", "down")
    ]
    head12 = for_rows(model.lm_head, 1).p12
    need = sum(p.N * p.K * 3 // 2 for p in layers12)
    free = 2 * need + head12.N * head12.K * 3 // 2
    monkeypatch.setattr("iterserve.model.runner._available_memory", lambda: free)
    runner = case("llama").runner(dtype="bfloat16", cache_config=cc)
    assert for_rows(runner.model.layers[0].qkv, 1).p12 is not None
    assert for_rows(runner.model.lm_head, 1).p12 is None


def test_fused_decode_runs_its_plan_as_it_stands(
    case: Callable[[str], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_layers takes the plan's structures themselves (views into its array): a change
    to a plan item reaches the next step (benchmarks/amx_epilogues.py flips the SwiGLU bit
    that way), and the structures' copy it ran before did not. And a step on another tuple of
    KV caches reads and writes those caches, not the first ones."""
    cc = CacheConfig(block_size=BLOCK, num_kv_blocks=8 * 16)
    fused, plain, fd = _fused_and_plain(case("llama"), "pairs", cc, monkeypatch)
    plan = fd.plan(3)
    assert plan is not None and all(w.amx >> 4 & 1 for w in plan)  # the SwiGLU epilogue
    for w in plan:
        w.amx &= ~(1 << 4)
    built = fd._plans[3]
    assert built is not None and not any(w.amx >> 4 & 1 for w in built[2])
    prompts = [prompt(9 + i, seed=60 + i) for i in range(3)]
    tables = [[16 * i + j for j in range(16)] for i in range(3)]
    pre = [BatchItem(f"s{i}", p[:-1], 0, tables[i], False) for i, p in enumerate(prompts)]
    step = [BatchItem(f"s{i}", [p[-1]], len(p) - 1, tables[i], True) for i, p in enumerate(prompts)]
    for r in (fused, plain):
        r.execute(pre)
    assert torch.equal(fused.execute(step), plain.execute(step))  # the same bits either way
    # another tuple of caches: the step reads and writes those (the old ones, zeroed, neither
    # give their zeros to the logits nor get the step's K and V)
    old = fused.kv_caches
    fused.kv_caches = tuple((k.clone(), v.clone()) for k, v in old)
    for k, v in old:
        k.zero_()
        v.zero_()
    assert torch.equal(fused.execute(step), plain.execute(step))
    for (ka, va), (kb, vb) in zip(fused.kv_caches, plain.kv_caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert all(not k.any() and not v.any() for k, v in old)
