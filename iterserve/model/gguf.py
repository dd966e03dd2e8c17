"""GGUF files (llama.cpp's format) as Hugging Face checkpoint folders.

``convert_gguf(path)`` turns a ``.gguf`` file into a folder under ``$ITERSERVE_CACHE/models/``
once (keyed by the file's real path, size and mtime), so everything downstream (the loader, the
tokenizer, transformers itself) reads an ordinary checkpoint:

    config.json             from the GGUF metadata (``hf_config``)
    tokenizer files         transformers' own GGUF tokenizer conversion, chat template included
    generation_config.json  bos / eos (+ llama.cpp's other end-of-generation ids) from metadata
    model.safetensors       every tensor dequantized with the ``gguf`` package (llama.cpp's own
                            reader); quantized types as float32, F16 / BF16 kept as they are
                            (both exact); the loader casts to the run's dtype as for any model

llama.cpp stores a llama-architecture q/k projection with each head's rotary halves
interleaved; the conversion undoes that as transformers does (qwen2/qwen3 GGUFs are not
permuted). ``write_gguf`` goes the other way for tests: a checkpoint folder as a GGUF file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from iterserve.model.builtin import cache_dir, materialise
from iterserve.model.model_config import _eos_ids, _parse_rope

# Weight types the gguf package dequantizes that this conversion accepts (and tests).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# general.architecture -> transformers class. Mistral GGUFs say "llama" and llama.cpp runs them
# as llama (no sliding window); so does this conversion.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp's convert_hf_to_gguf.py permutes q/k for these only
# bump when the conversion's output changes, so stale caches are not reused (v2: llama
# mlp_bias read from the tensors)
_VERSION = "v2"

# GGUF tensor name pieces -> Hugging Face ones (one table, read both ways).
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


_HF_TOP = {v: k for k, v in _TOP_NAMES.items()}
_HF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}


def _gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in _HF_TOP:
        return f"{_HF_TOP[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{_HF_LAYER[rest]}.{suffix}"


def _rotary_layout(w: np.ndarray, n_head: int, to_gguf: bool) -> np.ndarray:
    # Per head, HF keeps the rotary halves [x0..x_{d/2}, y0..]; llama.cpp interleaves the pairs.
    pair = (2, w.shape[0] // n_head // 2) if to_gguf else (w.shape[0] // n_head // 2, 2)
    return w.reshape(n_head, *pair, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _check_supported(reader: Any, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r} has architecture {arch!r}, which iterserve does not support; "
            f"supported: {', '.join(ARCHITECTURES)} (mistral GGUFs say llama)"
        )
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF file {path!r}: tensor {t.name!r} has type {t.tensor_type.name}, which "
                f"iterserve does not support; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        if t.name == "rope_freqs.weight":
            raise ValueError(
                f"GGUF file {path!r} carries rope_freqs.weight (Llama 3.1-style RoPE scaling), "
                "which the conversion cannot express yet; use the model's Hugging Face folder"
            )
        if hf_name(t.name) is None:
            raise ValueError(f"GGUF file {path!r} has tensor {t.name!r}, unknown for {arch}")
    if _field(reader, "tokenizer.ggml.model") is None:
        raise ValueError(
            f"GGUF file {path!r} has no tokenizer (tokenizer.ggml.* metadata); "
            "use a GGUF exported with its tokenizer, or the model's Hugging Face folder"
        )
    return str(arch)


def convert_gguf(path: str) -> str:
    """The cached Hugging Face-format folder for the GGUF file ``path`` (converted on first use)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{_VERSION}".encode()).hexdigest()
    stem = os.path.basename(real).removesuffix(".gguf")
    final = os.path.join(cache_dir(), "models", f"gguf-{stem}-{key[:16]}")
    return materialise(final, lambda out: _convert_into(real, out))


def hf_config(reader: Any, arch: str) -> dict[str, Any]:
    """config.json for the GGUF behind ``reader`` (an open ``gguf.GGUFReader``), from its
    ``<arch>.*`` metadata with llama.cpp's defaults; tied embeddings when it has no
    output.weight, attention biases when it has attn_q.bias."""

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}")
        return default if value is None else value

    names = {t.name for t in reader.tensors}
    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
    }
    scaling = meta("rope.scaling.type", "none")
    if scaling == "linear":
        rope |= {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"GGUF RoPE scaling {scaling!r} is not supported; supported: none, linear")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size", None if tokens is None else len(tokens.data))
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    token_ids = {
        k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")
    }
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        # llama's MLP biases (the Llama config's mlp_bias); the qwen families have none
        **({"mlp_bias": "blk.0.ffn_down.bias" in names} if arch == "llama" else {}),
        "bos_token_id": token_ids["bos"],
        "eos_token_id": token_ids["eos"],
        "pad_token_id": token_ids["padding"],
    }


def open_gguf(path: str, reader_cls: Any) -> Any:
    """``reader_cls(path)`` (a ``gguf.GGUFReader``), or a ValueError that says the file is cut
    short or damaged: the reader fails deep in numpy ("cannot reshape array of size 214336
    into shape (49152,612)" for a download cut at 2 MB), which names neither."""
    try:
        return reader_cls(path)
    except (ValueError, IndexError, KeyError) as e:  # an OSError says what it is itself
        size = os.path.getsize(path)
        raise ValueError(
            f"{path} ({size:,} bytes) cannot be read as a GGUF file (gguf: {type(e).__name__}: "
            f"{e}); a download cut short or damaged fails so: download it again"
        ) from None


def _convert_into(path: str, out: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = open_gguf(path, GGUFReader)
    arch = _check_supported(reader, path)
    config = hf_config(reader, arch)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    folder, fname = os.path.split(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(out)

    # llama.cpp stops at every end-of-generation id it knows, not only eos.
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": list(dict.fromkeys(int(i) for i in eos if i is not None)),
        "pad_token_id": config["pad_token_id"],
    }
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v not in (None, [])}, f, indent=2)

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    keep = {"F16": torch.float16, "BF16": torch.bfloat16}  # exact; quantized types need float32
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        kind = t.name.split(".")[-2]
        if arch in _PERMUTED_ARCHS and kind in heads:
            w = _rotary_layout(w, heads[kind], to_gguf=False)
        tensor = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).copy())
        state[str(hf_name(t.name))] = tensor.to(keep.get(t.tensor_type.name, torch.float32))
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


# ---- writing (tests, exports) -------------------------------------------------------------

Quantizer = Callable[[np.ndarray, Any], np.ndarray]


def write_gguf(
    checkpoint: str,
    out_path: str,
    qtype: str | Mapping[str, str] = "F32",
    quantize: Quantizer | None = None,
) -> str:
    """Writes the llama/qwen2/qwen3 checkpoint folder ``checkpoint`` (byte-level BPE
    ``tokenizer.json``) as a GGUF file; returns ``out_path``. Matrices are stored in ``qtype``:
    one type name for all, or a type per GGUF tensor kind (``{"attn_q": "Q4_K", ...}``, F32 for
    kinds not named). Norms and biases stay F32, as llama.cpp keeps them.
    ``quantize(array, GGMLQuantizationType)`` makes a matrix's bytes: ``gguf.quants.quantize``
    by default (which has no K-quant encoder)."""
    import gguf
    from safetensors.torch import load_file

    quantize = quantize or gguf.quants.quantize

    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    arch = cfg["model_type"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"write_gguf handles {list(ARCHITECTURES)}, got model_type {arch!r}")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # read as the loader reads it (rope_scaling over rope_parameters, a top-level theta)
    rope = _parse_rope(cfg, max_pos)

    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(os.path.basename(os.path.normpath(checkpoint)))
    w.add_context_length(max_pos)
    w.add_embedding_length(hidden)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope.theta)
    # the scaling hf_config reads back (it was dropped: a different model, silently)
    if rope.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.factor)
    elif rope.rope_type != "default":
        raise ValueError(
            f"write_gguf writes RoPE scaling 'linear' or none, not {rope.rope_type!r} "
            "(llama.cpp keeps llama3's as a rope_freqs tensor, which this writer does not make)"
        )
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    _add_tokenizer(w, checkpoint, cfg)

    state: dict[str, torch.Tensor] = {}
    for fname in sorted(os.listdir(checkpoint)):
        if fname.endswith(".safetensors"):
            state.update(load_file(os.path.join(checkpoint, fname)))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    n_heads = {"q_proj": heads, "k_proj": kv_heads}
    for name, tensor in state.items():
        arr = tensor.float().numpy()
        kind = name.split(".")[-2]
        if arch in _PERMUTED_ARCHS and kind in n_heads:
            arr = _rotary_layout(arr, n_heads[kind], to_gguf=True)
        gguf_name = _gguf_name(name)
        type_name = qtype if isinstance(qtype, str) else qtype.get(gguf_name.split(".")[-2], "F32")
        qt = gguf.GGMLQuantizationType[type_name]
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.ascontiguousarray(arr))
        else:
            w.add_tensor(gguf_name, quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _add_tokenizer(w: Any, checkpoint: str, cfg: dict[str, Any]) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's "gpt2" model, with its special
    tokens marked CONTROL and its chat template."""
    import gguf

    with open(os.path.join(checkpoint, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {a["content"]: int(a["id"]) for a in tok.get("added_tokens", []) if a.get("special")}
    vocab.update(special)
    n_vocab = int(cfg["vocab_size"])
    tokens = [f"<|unused_{i}|>" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in vocab.items():
        if i >= n_vocab:
            raise ValueError(f"tokenizer.json token {text!r} has id {i} >= vocab_size {n_vocab}")
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    # whether the tokenizer adds a BOS to text (Llama's do)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(checkpoint)
    bos = cfg.get("bos_token_id", hf_tok.bos_token_id)
    bos = bos[0] if isinstance(bos, list) and bos else bos
    with_special = hf_tok("x", add_special_tokens=True)["input_ids"]
    w.add_add_bos_token(bool(with_special) and bos is not None and with_special[0] == bos)
    for key, add in (("bos", w.add_bos_token_id), ("pad", w.add_pad_token_id)):
        value = cfg.get(f"{key}_token_id")
        if value is not None:
            add(int(value[0] if isinstance(value, list) else value))
    # every stop id the model stops at (generation_config.json's list wins, as the loader
    # reads it), as llama.cpp's eos, eot and eom, which the reader gathers back
    gen_path = os.path.join(checkpoint, "generation_config.json")
    gen: dict[str, Any] = {}
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    stops = _eos_ids(cfg, gen)
    if len(stops) > 3:
        raise ValueError(
            f"the checkpoint stops at {len(stops)} token ids {list(stops)}; a GGUF holds three "
            "(eos, eot, eom): keep the three that matter in generation_config.json's "
            "eos_token_id"
        )
    for tid, add in zip(stops, (w.add_eos_token_id, w.add_eot_token_id, w.add_eom_token_id)):
        add(tid)
    tok_cfg_path = os.path.join(checkpoint, "tokenizer_config.json")
    template_path = os.path.join(checkpoint, "chat_template.jinja")
    template = None
    if os.path.isfile(template_path):
        with open(template_path) as f:
            template = f.read()
    elif os.path.isfile(tok_cfg_path):
        with open(tok_cfg_path) as f:
            template = json.load(f).get("chat_template")
    if template:
        w.add_chat_template(template)
