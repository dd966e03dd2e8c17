"""Loads Hugging Face safetensors weights (single file or sharded with an index) straight into
``DecoderModel``'s fused parameters, without instantiating any transformers model."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import cast

import torch
from safetensors import safe_open

from iterserve.model.llama import DecoderLayer, DecoderModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that a serving model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> file holding it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        for fpath in set(files.values()):
            if not os.path.isfile(fpath):
                raise FileNotFoundError(
                    f"{INDEX_FILE} in {path!r} names shard {os.path.basename(fpath)!r}, "
                    "which is missing"
                )
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        found = sorted(f for f in os.listdir(path) if not f.startswith("."))
        raise FileNotFoundError(
            f"no weights in {path!r}: expected {SINGLE_FILE} or {INDEX_FILE} with shards; "
            f"found {found}"
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


Target = tuple[torch.Tensor, int, int]  # (our parameter, first row, rows to broadcast into or 0)


def weight_targets(model: DecoderModel) -> dict[str, Target]:
    """HF tensor name -> where it goes. Fused matrices take several HF tensors stacked along
    dim 0: qkv = [q; k; v], gate_up = [gate; up]; the per-head qk_norm weight is broadcast to
    one row per head: [q_norm x H; k_norm x KvH]."""
    cfg = model.cfg
    t: dict[str, Target] = {
        "model.embed_tokens.weight": (model.embed_tokens, 0, 0),
        "model.norm.weight": (model.norm, 0, 0),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (model.lm_head, 0, 0)
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        p = f"model.layers.{i}."
        q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate
        t[p + "input_layernorm.weight"] = (layer.input_norm, 0, 0)
        t[p + "post_attention_layernorm.weight"] = (layer.post_norm, 0, 0)
        for name, row in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)):
            t[p + f"self_attn.{name}.weight"] = (layer.qkv_proj, row, 0)
            if layer.qkv_bias is not None:
                t[p + f"self_attn.{name}.bias"] = (layer.qkv_bias, row, 0)
        t[p + "self_attn.o_proj.weight"] = (layer.o_proj, 0, 0)
        if layer.o_bias is not None:
            t[p + "self_attn.o_proj.bias"] = (layer.o_bias, 0, 0)
        for name, row in (("gate_proj", 0), ("up_proj", inter)):
            t[p + f"mlp.{name}.weight"] = (layer.gate_up_proj, row, 0)
            if layer.gate_up_bias is not None:
                t[p + f"mlp.{name}.bias"] = (layer.gate_up_bias, row, 0)
        if layer.qk_norm is not None:
            t[p + "self_attn.q_norm.weight"] = (layer.qk_norm, 0, layer.num_heads)
            t[p + "self_attn.k_norm.weight"] = (layer.qk_norm, layer.num_heads, layer.num_kv_heads)
        t[p + "mlp.down_proj.weight"] = (layer.down_proj, 0, 0)
        if layer.down_bias is not None:
            t[p + "mlp.down_proj.bias"] = (layer.down_bias, 0, 0)
    return t


def load_weights(model: DecoderModel, path: str) -> None:
    files = weight_files(path)
    targets = weight_targets(model)
    missing = [name for name in targets if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint {path!r} lacks tensor {missing[0]!r}{more}")

    filled: dict[int, int] = defaultdict(int)  # id(param) -> rows written, to catch short tensors
    tied_head: str | None = None  # the file of an lm_head.weight a tied config does not read
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, fpath in files.items():
        by_file[fpath].append(name)
    with torch.no_grad():
        for fpath, names in by_file.items():
            with safe_open(fpath, framework="pt") as f:
                for name in names:
                    if name in targets:
                        filled[id(targets[name][0])] += _copy_into(
                            model, targets[name], f.get_tensor(name), name
                        )
                    elif name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                        tied_head = fpath
                    elif not name.endswith(_IGNORED_SUFFIXES):
                        raise ValueError(
                            f"checkpoint {path!r} has unexpected tensor {name!r} "
                            f"for {model.cfg.architecture}"
                        )
    if tied_head is not None:
        _check_tied_head(model, tied_head, path)
    for name, (param, _, _) in targets.items():
        if filled[id(param)] != param.shape[0]:
            raise ValueError(
                f"checkpoint {path!r}: tensor {name!r} (and the ones fused with it) filled "
                f"{filled[id(param)]} of {param.shape[0]} rows; "
                "config.json dimensions do not match the weights"
            )


def _check_tied_head(model: DecoderModel, fpath: str, path: str) -> None:
    """A tied config whose checkpoint also holds an lm_head.weight: fine where it equals the
    embeddings (as the checkpoint dtype casts them). Where it differs, transformers 5 uses
    it (untied) and transformers 4 tied them, so refuse rather than pick one silently."""
    emb = model.embed_tokens
    with safe_open(fpath, framework="pt") as f, torch.no_grad():
        head = f.get_slice("lm_head.weight")
        shape = tuple(head.get_shape())
        same = shape == tuple(emb.shape)
        for r in range(0, shape[0] if same else 0, 4096):  # in slices: vocab x hidden is big
            if not torch.equal(head[r : r + 4096].to(emb.dtype), emb[r : r + 4096]):
                same = False
                break
    if not same:
        raise ValueError(
            f"checkpoint {path!r}: config.json sets tie_word_embeddings but the checkpoint's "
            "lm_head.weight differs from model.embed_tokens.weight (transformers 5 uses the "
            "lm_head, transformers 4 tied them); set tie_word_embeddings to false to use the "
            "lm_head, or remove it from the checkpoint to tie"
        )


def _copy_into(model: DecoderModel, target: Target, src: torch.Tensor, name: str) -> int:
    param, row, broadcast = target
    cfg = model.cfg
    if broadcast:
        src = src.expand(broadcast, *src.shape)
    if row + src.shape[0] > param.shape[0] or tuple(src.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(src.shape)}, which does not fit {cfg.architecture} "
            f"with the dimensions in config.json (target {tuple(param.shape)} at row {row})"
        )
    param[row : row + src.shape[0]].copy_(src)  # copy_ also casts to the serving dtype
    return int(src.shape[0])
