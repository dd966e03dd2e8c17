"""Reads a Hugging Face checkpoint folder's ``config.json`` (+ ``generation_config.json``) into
one frozen, validated ``ModelConfig`` that the decoder, the loader and the runner share.

Four decoder families share one implementation; they differ only in the flags below:

    family   qkv bias          o bias            qk-norm   sliding window
    llama    attention_bias    attention_bias    no        no
    mistral  no                no                no        sliding_window (all layers)
    qwen2    yes               no                no        only if use_sliding_window (rejected)
    qwen3    attention_bias    attention_bias    yes       only if use_sliding_window (rejected)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' num_key_value_heads where config.json leaves it out: MistralConfig's and the
# Qwen configs' defaults (LlamaConfig takes num_attention_heads)
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32}


def _default_kv_heads(family: str, heads: int) -> int:
    """transformers' default where it divides the attention heads; the heads otherwise (a
    default that does not divide them could load no weights, in transformers either)."""
    d = _DEFAULT_KV_HEADS.get(family)
    return d if d is not None and heads % d == 0 else heads


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    # llama3 only: frequencies are rescaled by wavelength relative to the pretraining length.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # keys within the last `sliding_window` positions
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += h if self.o_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        path = os.fspath(path)
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            found = sorted(os.listdir(path)) if os.path.isdir(path) else "no such folder"
            raise FileNotFoundError(
                f"expected a Hugging Face checkpoint folder with config.json at {path!r}; "
                f"found: {found}"
            )
        with open(cfg_file) as f:
            hf: dict[str, Any] = json.load(f)
        return cls.from_dict(hf, read_generation_config(path))

    @classmethod
    def from_dict(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = hf.get("architectures") or []
        if not archs and hf.get("model_type") in ARCHITECTURES.values():
            # no architectures list: the model type names the class, as transformers' Auto
            # classes read it
            archs = [next(a for a, f in ARCHITECTURES.items() if f == hf["model_type"])]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        required = (
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "intermediate_size",
            "vocab_size",
        )
        absent = [k for k in required if k not in hf]
        if absent:
            raise ValueError(f"config.json for {arch} lacks {absent}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")

        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        # transformers' defaults where config.json leaves a key out (Qwen3Config's head_dim
        # is 128, the others' hidden / heads)
        head_dim = hf.get("head_dim") or (128 if family == "qwen3" else hidden // heads)
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = {
            "llama": attention_bias,
            "mistral": False,
            "qwen2": True,
            "qwen3": attention_bias,
        }[family]
        o_bias = qkv_bias if family in ("llama", "qwen3") else False

        sliding: int | None = None
        if family == "mistral":
            sliding = hf.get("sliding_window", 4096)  # MistralConfig's default
        elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            # transformers' layer types: sliding from max_window_layers on, unless listed
            window = hf.get("sliding_window", 4096)
            first = int(hf.get("max_window_layers", 28))
            layer_types = hf.get("layer_types") or [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(int(hf["num_hidden_layers"]))
            ]
            if "sliding_attention" in layer_types:
                raise ValueError(
                    f"{arch} with sliding-window layers (use_sliding_window=true, "
                    f"layers from max_window_layers {first} on) is not supported: iterserve "
                    "runs one attention kind in every layer"
                )

        # transformers' defaults where config.json leaves it out
        default_pos = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
        max_pos = int(hf.get("max_position_embeddings", default_pos[family]))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or _default_kv_heads(family, heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(hf, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=_eos_ids(hf, generation or {}),
            bos_token_id=(generation or {}).get("bos_token_id", hf.get("bos_token_id")),
            hf_config=hf,
        )


def read_generation_config(
    folder: str | os.PathLike[str], required: bool = False
) -> dict[str, Any]:
    """``folder``'s generation_config.json as a dict; {} where there is none, unless
    ``required`` (then FileNotFoundError naming what the folder holds)."""
    gen_file = os.path.join(os.fspath(folder), "generation_config.json")
    if not os.path.isfile(gen_file):
        if not required:
            return {}
        if os.path.isfile(folder):
            found: object = "a file; pass the folder that holds it"
        else:
            found = sorted(os.listdir(folder)) if os.path.isdir(folder) else "no such folder"
        raise FileNotFoundError(
            f"generation_config: expected a folder with a generation_config.json at "
            f"{os.fspath(folder)!r}; found: {found}"
        )
    with open(gen_file) as f:
        try:
            gen = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{gen_file} is not valid JSON: {e}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{gen_file} must hold a JSON object, got {type(gen).__name__}")
    return gen


def _parse_rope(hf: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers 5 writes everything under `rope_parameters`; older checkpoints (Llama 3 on the
    # Hub) use `rope_theta` at top level plus an optional `rope_scaling` dict.
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
    # transformers' precedence: a rope_scaling dict replaces rope_parameters (model cards
    # tell users to add rope_scaling to a config transformers 5 wrote rope_parameters into)
    scaling = hf.get("rope_scaling") or {}
    params = dict(scaling) if scaling else params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    if (
        float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
        != 1.0
    ):
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ValueError(
            f"rope_type {rope_type!r} needs a 'factor' in rope_parameters/rope_scaling"
        )
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        # transformers gives a top-level value priority (as Phi-3 configs write it)
        original_max_position_embeddings=int(
            hf.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings", max_pos)
        ),
    )


def _eos_ids(hf: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json wins: chat models list several stop ids there (e.g. Llama 3's
    # <|eot_id|>) while config.json keeps only the base eos.
    raw = gen.get("eos_token_id", hf.get("eos_token_id"))
    ids = raw if isinstance(raw, list) else [] if raw is None else [raw]
    return tuple(dict.fromkeys(int(i) for i in ids))


def check_not_quantized(cfg: ModelConfig) -> None:
    """Loading weights: a quantized checkpoint's (FP8, GPTQ, AWQ) are not plain tensors.
    Its shape alone (the simulator's use of a config) is fine."""
    q = cfg.hf_config.get("quantization_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise ValueError(
            f"quantized checkpoints ({method}) are not supported; use an unquantized "
            "(bf16 / fp16 / fp32) checkpoint, or a GGUF file"
        )


def context_length(max_model_len: int | None, cfg: ModelConfig) -> int:
    """The context a run serves: ``max_model_len``, or the model's own where None. Past the
    model's ``max_position_embeddings`` it is an error, as in vLLM (it used to be cut to it
    without a word)."""
    limit = cfg.max_position_embeddings
    if max_model_len is None:
        return limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len {max_model_len} is more than the model's context, "
            f"max_position_embeddings {limit} in its config.json; lower max_model_len "
            "(or leave it unset for the model's)"
        )
    return max_model_len
