"""Readable torch reference for paged attention over the engine's KV-cache layout (any device).

This is the oracle the Triton kernels (``triton_attention.py``) are tested against; it favours
clarity over speed (a Python loop over sequences, float32 math).

Layout, the same as ``attention.py`` and ``runner.py``: one layer's cache is two tensors
``k_cache, v_cache`` of shape ``[num_blocks * block_size, num_kv_heads, head_dim]``; position p
of sequence b lives at slot ``block_tables[b, p // block_size] * block_size + p % block_size``.

A step is a ragged batch of B sequences, ``query_start_loc`` ([B + 1], cumulative) saying which
rows of ``q`` belong to which sequence and ``seq_lens`` ([B]) how many positions each sequence
has once this step's tokens are in the cache. Sequence b's n_b new tokens are its LAST n_b
positions, ``seq_lens[b] - n_b .. seq_lens[b] - 1``: a fresh prompt has n_b == seq_lens[b], a
chunk after a cached prefix has fewer, a decode has n_b == 1. A query at position p sees the
keys at positions ``max(0, p - sliding_window + 1) .. p`` (all of ``0 .. p`` without a window).
"""

from __future__ import annotations

import math

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, KvH, D] go to rows ``slot_mapping`` [T] of the caches; slot -1 = padding
    row, skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots] = key[keep].to(k_cache.dtype)
    v_cache[slots] = value[keep].to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (rows grouped by sequence as ``query_start_loc`` says) -> [T, H, D] in
    q's dtype. Reads every key, the step's new ones included, from the cache: write them first
    (``write_kv_cache``)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]  # query heads per KV head (GQA)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        key_pos = torch.arange(ctx, device=q.device)
        slots = block_tables[b, key_pos // block_size].long() * block_size + key_pos % block_size
        # [ctx, KvH, D] -> [ctx, H, D]: query head h reads KV head h // group.
        k = k_cache[slots].float().repeat_interleave(group, dim=1)
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,khd->hnk", q[q0:q1].float(), k) * scale
        q_pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)[:, None]
        allowed = key_pos[None, :] <= q_pos
        if sliding_window is not None:
            allowed &= key_pos[None, :] > q_pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[q0:q1] = torch.einsum("hnk,khd->nhd", probs, v).to(q.dtype)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [B, H, D], one new token per sequence (the 1-token case of ``paged_attention``)."""
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        block_size,
        scale,
        sliding_window,
    )
