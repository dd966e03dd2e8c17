"""Paged attention on CPU over a flattened (ragged) batch.

The KV cache of one layer is two tensors of shape [num_blocks * block_size, num_kv_heads,
head_dim]; token at position p of a sequence lives at slot
``block_table[p // block_size] * block_size + p % block_size``.

The runner orders a step's rows decode-first:

    rows:  [ d0 d1 ... d(D-1) | chunk0 (n0 rows) | chunk1 (n1 rows) | ... ]
             one token each       prefill chunks (or any item with > 1 token)

so all decodes run as ONE call of iterserve's paged decode kernel (the ``cpu`` backend: each
over its own context, read in place) or one SDPA over the contexts gathered into a padded
[D, max_blocks * block_size] window, a key-padding mask hiding the tail (the ``torch``
backend), and each prefill chunk runs one SDPA with a causal mask shifted by its start
position. ``AttentionMetadata``
holds every index and mask for that; it is built once per step and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve.model import kernels
from iterserve.model.cpu import needs_upcast

# Each layer's (K, V) cache: a tuple, never changed in place, so a check of one such object
# holds for as long as it is passed (fused_decode.py checks the caches once per object).
KVCaches = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    end: int  # one past its last row
    ctx_len: int  # keys visible to the chunk's last token = start_pos + (end - start)
    # Blocks holding positions [0, ctx_len); None when the chunk starts at position 0, so its own
    # fresh K/V are the whole context and nothing needs gathering from the cache.
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None  # [n, ctx_len] additive (0 / -inf); None = plain causal
    start_pos: int = 0
    # Blocks holding positions [0, ctx_len), whatever the start (iterserve's prefill kernel
    # reads every key from the cache); None: not built (a sliding window: SDPA only).
    table: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    num_decodes: int  # rows [0, num_decodes) are single-token items
    decode_block_ids: torch.Tensor | None  # [D * max_blocks] int64, row-major, padded with block 0
    prefills: list[PrefillChunk]
    block_size: int
    mask_dtype: torch.dtype  # the dtype SDPA computes the decodes in
    # For iterserve's paged decode kernel: decode d sees keys
    # [decode_starts[d], decode_ctx_lens[d]).
    decode_ctx_lens: torch.Tensor | None = None  # [D] int64
    decode_starts: torch.Tensor | None = None  # [D] int64 (> 0 only under a sliding window)
    _decode_mask: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """[D, 1, 1, max_blocks * block_size] additive (0 / -inf) over the padded window of
        ``sdpa_decodes``: key j is seen where starts <= j < ctx_lens. Built on first use, on
        the ctx lens' device: the kernel decodes never read it, and its torch ops cost a
        decode step's Python more than the kernel path's whole metadata (docs/SPEED.md)."""
        D = self.num_decodes
        if self._decode_mask is None and D:
            assert self.decode_block_ids is not None
            assert self.decode_ctx_lens is not None and self.decode_starts is not None
            keys = self.decode_block_ids.numel() // D * self.block_size
            key_pos = torch.arange(keys, device=self.decode_ctx_lens.device)
            seen = (key_pos < self.decode_ctx_lens[:, None]) & (
                key_pos >= self.decode_starts[:, None]
            )
            self._decode_mask = _additive(seen, self.mask_dtype).view(D, 1, 1, keys)
        return self._decode_mask


@dataclass
class StepItem:
    """The part of a BatchItem that attention needs (rows already laid out decode-first)."""

    num_tokens: int
    start_pos: int
    block_table: Sequence[int]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA would convert a bool mask to this form in every layer; do it once per step.
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def build_attention_metadata(
    items: Sequence[StepItem],
    num_decodes: int,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """``items[:num_decodes]`` have one token each; the rest follow in row order. Every query
    sees at least its own key, so no mask row is all -inf. Masks are in the dtype attention
    computes in (f32 where this CPU only emulates ``dtype``, see ``paged_attention``)."""
    dtype = torch.float32 if needs_upcast(dtype) else dtype
    # Every index of the step goes into one int64 tensor (one torch call, not one per field or
    # chunk); the fields are views of it.
    ints: list[int] = []
    for it in items:
        bt, p0 = it.block_table, it.start_pos
        ints.extend(
            bt[p // block_size] * block_size + p % block_size for p in range(p0, p0 + it.num_tokens)
        )
    T = len(ints)
    D = num_decodes
    if D:
        decodes = items[:D]
        nblocks = [it.start_pos // block_size + 1 for it in decodes]
        max_blocks = max(nblocks)
        for it, nb in zip(decodes, nblocks):
            ints.extend(it.block_table[:nb])
            ints.extend([0] * (max_blocks - nb))  # padding keys, masked out
        ctx = [it.start_pos + 1 for it in decodes]
        ints.extend(ctx)
        ints.extend(0 if sliding_window is None else max(c - sliding_window, 0) for c in ctx)
    bounds = [len(ints)]  # each prefill chunk's table is ints[bounds[i] : bounds[i + 1]]
    for it in items[D:]:
        ints.extend(it.block_table[: (it.start_pos + it.num_tokens - 1) // block_size + 1])
        bounds.append(len(ints))
    flat = torch.tensor(ints, dtype=torch.int64)
    slot_mapping = flat[:T]
    decode_block_ids = ctx_lens = starts = None
    if D:
        e = T + D * max_blocks
        decode_block_ids, ctx_lens, starts = flat[T:e], flat[e : e + D], flat[e + D : e + 2 * D]

    prefills: list[PrefillChunk] = []
    row = D
    for it, a, b in zip(items[D:], bounds, bounds[1:]):
        table = flat[a:b]
        n, p0 = it.num_tokens, it.start_pos
        ctx_len = p0 + n
        block_ids = table if p0 > 0 else None
        chunk_mask = None
        windowed = sliding_window is not None and (p0 > 0 or n > sliding_window)
        if windowed:
            assert sliding_window is not None
            q_pos = torch.arange(p0, ctx_len)[:, None]
            key_pos = torch.arange(ctx_len)
            chunk_mask = _additive((key_pos <= q_pos) & (key_pos > q_pos - sliding_window), dtype)
        elif p0 > 0:
            # Query i (position p0 + i) sees keys 0 .. p0 + i: -inf above diagonal p0. Two ops
            # instead of six; at 497 x 1009 (a continued chunk of 512) 0.16 against 0.48 ms.
            chunk_mask = torch.full((n, ctx_len), float("-inf"), dtype=dtype).triu_(p0 + 1)
        prefills.append(
            PrefillChunk(
                row, row + n, ctx_len, block_ids, chunk_mask, p0, None if windowed else table
            )
        )
        row += n
    return AttentionMetadata(
        slot_mapping, D, decode_block_ids, prefills, block_size, dtype, ctx_lens, starts
    )


def write_new_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Every new K/V of the step goes in before any read, so sequences sharing prefix blocks
    within one step see each other's writes."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)


def kernel_write_new_kv(
    kern: kernels.Kernels,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """``write_new_kv`` through iterserve's row copy (a parallel memcpy per row: at 2,048 rows
    it takes a fraction of index_copy_'s time, docs/SPEED.md, "Prefill")."""
    kern.write_rows(k, k_cache, meta.slot_mapping)
    kern.write_rows(v, v_cache, meta.slot_mapping)


def sdpa_decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
) -> torch.Tensor:
    """Rows [0, D): the decodes' blocks gathered into a window padded to the longest context,
    one SDPA under a key-padding mask. Returns [D, H, hd] (f32 where the dtype is emulated)."""
    D, H, hd = q.shape[0], q.shape[1], q.shape[2]
    kvh = k_cache.shape[1]
    assert meta.decode_block_ids is not None
    # GQA without repeating K/V: the G query heads of one KV head become G query rows.
    qd = q[:D].reshape(D, kvh, H // kvh, hd)
    # index_select over whole blocks (flat ids) is a row memcpy; 2-D fancy indexing is ~2x slower.
    kd = k_cache.view(-1, block_size, kvh, hd).index_select(0, meta.decode_block_ids)
    vd = v_cache.view(-1, block_size, kvh, hd).index_select(0, meta.decode_block_ids)
    if needs_upcast(q.dtype):
        qd, kd, vd = qd.float(), kd.float(), vd.float()
    kd = kd.view(D, -1, kvh, hd).transpose(1, 2)
    vd = vd.view(D, -1, kvh, hd).transpose(1, 2)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)


def kernel_decodes(
    kern: kernels.Kernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    prefetch: int = kernels.DECODE_PREFETCH,
    prefetch_l2: bool = False,
) -> torch.Tensor:
    """Rows [0, D) through iterserve's paged decode kernel: each decode reads only its own
    context, in place, softmax vectorised on every thread (docs/SPEED.md, "Decode attention");
    ``prefetch``: its software prefetch distance (0: none), into L2 only where ``prefetch_l2``.
    Returns [D, H, hd]."""
    D = q.shape[0]
    assert meta.decode_block_ids is not None
    assert meta.decode_ctx_lens is not None and meta.decode_starts is not None
    return kern.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.decode_block_ids.view(D, -1),
        meta.decode_ctx_lens,
        meta.decode_starts,
        block_size,
        prefetch,
        prefetch_l2,
    )


def sdpa_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c: PrefillChunk,
    block_size: int,
) -> torch.Tensor:
    """One prefill chunk through SDPA (causal, shifted by its start position): [n, H * hd].
    Where this CPU only emulates the dtype, attention computes in f32 on the same values
    (docs/SPEED.md, "Decode attention")."""
    H, hd = q.shape[1], q.shape[2]
    kvh = k.shape[1]
    qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
    if c.block_ids is None:
        kc, vc = k[c.start : c.end], v[c.start : c.end]
    else:
        kc = k_cache.view(-1, block_size, kvh, hd).index_select(0, c.block_ids)
        vc = v_cache.view(-1, block_size, kvh, hd).index_select(0, c.block_ids)
        kc, vc = kc.view(-1, kvh, hd)[: c.ctx_len], vc.view(-1, kvh, hd)[: c.ctx_len]
    if needs_upcast(q.dtype):
        qc, kc, vc = qc.float(), kc.float(), vc.float()
    out = F.scaled_dot_product_attention(
        qc,
        kc.transpose(0, 1).unsqueeze(0),
        vc.transpose(0, 1).unsqueeze(0),
        attn_mask=c.mask,
        is_causal=c.mask is None,
        enable_gqa=kvh != H,
    )
    return out[0].transpose(0, 1).reshape(c.end - c.start, H * hd).to(q.dtype)


def prefill_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    kern: kernels.Kernels | None = None,
) -> list[torch.Tensor]:
    """[n, H * hd] per prefill chunk: through iterserve's prefill kernel where ``kern`` is given
    and the chunk is plain causal (keys read from the cache in place, no gather; docs/SPEED.md,
    "Closing the roofline gap"), else one SDPA (sliding-window chunks always)."""
    return [
        sdpa_chunk(q, k, v, k_cache, v_cache, c, block_size)
        if kern is None or c.table is None
        else kern.paged_prefill_attention(
            q[c.start : c.end], k_cache, v_cache, c.table, c.start_pos, block_size
        )
        for c in meta.prefills
    ]


def prefill_kernel_fits(kern: kernels.Kernels, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``prefill_chunks`` can take ``kern`` for this model: bf16, head_dim a multiple of
    64, and a CPU with AVX512-BF16 or AVX2 without AVX-512 (the kernel is compiled in there)."""
    return dtype == torch.bfloat16 and head_dim % 64 == 0 and kern.has_prefill_kernel


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    kern: kernels.Kernels | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KvH, D] (post-RoPE) -> attention output [T, H * D]. ``kern``:
    iterserve's kernels for the decodes (f32 or bf16 caches), else SDPA. The model calls an
    attention backend (attention_backends.py) instead; this is the same path in one call."""
    write_new_kv(k, v, k_cache, v_cache, meta)
    D = meta.num_decodes
    outs: list[torch.Tensor] = []
    if D:
        if kern is not None:
            out = kernel_decodes(kern, q[:D], k_cache, v_cache, meta, block_size)
        else:
            out = sdpa_decodes(q[:D], k_cache, v_cache, meta, block_size)
        outs.append(out.reshape(D, -1).to(q.dtype))
    outs += prefill_chunks(q, k, v, k_cache, v_cache, meta, block_size)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
