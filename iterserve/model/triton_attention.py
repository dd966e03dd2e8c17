"""iterserve's Triton kernels for paged attention (GPU; tested on CPU under TRITON_INTERPRET=1).

Same KV-cache layout and step description as ``attention_ref.py`` (the torch oracle these are
tested against): caches ``[num_blocks * block_size, num_kv_heads, head_dim]``, block tables
``[B, max_blocks]``, ``query_start_loc`` [B + 1], ``seq_lens`` [B] (positions per sequence
including this step's tokens, each >= 1).

    write_kv_cache           new K/V of the step into their slots (slot -1: skip)
    paged_decode_attention   one query token per sequence; split-KV ("flash-decoding") pass
                             writing per-split partial outputs + log-sum-exp, then a reduction
    paged_prefill_attention  the whole ragged batch (fresh prompts, chunks after a cached
                             prefix, decodes) in ONE launch, causal inside the new tokens

GQA everywhere: one program serves all query heads of one KV head, so each K/V tile is loaded
once for the whole group. Head dims that are not a power of two (80, 96) run in a padded,
masked tile. Inputs may be float32, float16 or bfloat16; dots take the storage dtype (tensor
cores) and accumulate in float32, and float32 dots are IEEE (no TF32), so float32 results can
match transformers token for token. Only long-stable Triton APIs are used (loads/stores with
masks, ``tl.dot``, constexpr tile sizes): the GPU image has Triton 3.6.

``TRITON_INTERPRET`` is read by ``triton.jit`` when this module is imported: set it before.
Nothing here has run on a GPU yet (see docs/GPU.md).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # `import iterserve` and the CPU path must not need triton
    HAS_TRITON = False

MAX_HEAD_DIM = 256  # a [BLOCK_M, 256] f32 accumulator is the most a program holds in registers
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """KV splits per sequence for decode: enough (batch x KV head x split) programs to fill
    about two waves of the GPU's SMs (132 on an H100/H200), at most 16. A host-side choice from
    shapes only, so a CUDA graph captured at a batch size keeps it."""
    return max(1, min(16, -(-2 * num_sms // max(batch * num_kv_heads, 1))))


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcs, stride_kch, stride_vcs, stride_vch,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # grid (T, KvH): one head of one new token per program.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # padding row (e.g. a CUDA graph's unused batch slot)
            return
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm)
        k_dst = k_cache_ptr + slot * stride_kcs + h * stride_kch + d
        v_dst = v_cache_ptr + slot * stride_vcs + h * stride_vch + d
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=dm)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _attend(
        q, q_pos, lo, hi, kvh, bt_row_ptr,
        k_cache_ptr, v_cache_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch, scale,
        window, SLIDING: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Online softmax of the ROWS query rows of q (positions q_pos) over the keys
        [lo, hi) of one sequence's KV head kvh, BLOCK_N keys a tile; a row sees keys <= its
        position (inside the window). Returns (normalised output, row max m, row sum l);
        l = 0 for a row that saw no key, whose output is 0."""
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        for start in range(lo, hi, BLOCK_N):  # one online-softmax step per key tile
            k_pos = start + tl.arange(0, BLOCK_N)
            km = k_pos < hi
            # Gather per key: any BLOCK_N works with any block size; a tile may span blocks.
            blk = tl.load(bt_row_ptr + k_pos // BLOCK_SIZE, mask=km, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + k_pos % BLOCK_SIZE
            kv_mask = km[:, None] & dm[None, :]
            k = tl.load(
                k_cache_ptr + slot[:, None] * stride_kcs + kvh * stride_kch + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr + slot[:, None] * stride_vcs + kvh * stride_vch + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            allowed = km[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if SLIDING:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            qk = tl.where(allowed, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row with no visible key yet (padding, or a window that starts after this tile)
            # keeps m = -inf; shift by 0 there so exp() gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], m_i, l_i

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
        scale, window, num_splits,
        stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_btb,
        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
        SLIDING: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        # grid (B, KvH, num_splits): split s of sequence b's visible keys, all GROUP query
        # heads of KV head kvh as the rows of one [BLOCK_G, BLOCK_D] tile.
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        lo = 0
        if SLIDING:
            lo = tl.maximum(seq_len - window, 0)
        split_len = tl.cdiv(seq_len - lo, num_splits)
        s_lo = lo + s * split_len
        s_hi = tl.minimum(s_lo + split_len, seq_len)

        g = tl.arange(0, BLOCK_G)
        heads = kvh * GROUP + g
        d = tl.arange(0, BLOCK_D)
        q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
        )
        q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + seq_len - 1  # the one new token
        o, m_i, l_i = _attend(
            q, q_pos, s_lo, s_hi, kvh, bt_ptr + b * stride_btb,
            k_cache_ptr, v_cache_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch, scale,
            window, SLIDING, BLOCK_SIZE, BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip
        # An empty split (more splits than keys) stores o = 0, lse = -inf: weight 0 in the
        # reduction, no branch needed.
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        mo = mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + s * stride_mos + d[None, :]
        tl.store(mo, o, mask=q_mask)
        tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + s, lse, mask=g < GROUP)

    @triton.jit
    def _decode_reduce_kernel(
        mid_o_ptr, mid_lse_ptr, out_ptr, num_splits,
        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        # grid (B, H): out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse); split 0
        # always holds a key (seq_len >= 1), so max lse is finite.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        sm = s < num_splits
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=sm, other=-1e30)
        lse = tl.where(lse == float("-inf"), -1e30, lse)
        w = tl.exp(lse - tl.max(lse, 0))
        o = tl.load(
            mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
            mask=sm[:, None] & dm[None, :],
            other=0.0,
        )
        res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
                 mask=dm)  # fmt: skip

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
        scale, window,
        stride_qt, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_btb,
        stride_ot, stride_oh,
        SLIDING: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        # grid (cdiv(max_query_len, BLOCK_Q), B, KvH), BLOCK_M = BLOCK_Q * GROUP_PAD. Tile rows
        # are (token, head) pairs:
        #   row r = i * GROUP_PAD + g  ->  new token qt * BLOCK_Q + i, query head kvh*GROUP + g
        # so BLOCK_Q tokens x all query heads of one KV head share every K/V tile.
        qt = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        kvh = tl.program_id(2)
        q_start = tl.load(qsl_ptr + b).to(tl.int32)
        q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
        if qt * BLOCK_Q >= q_len:  # this sequence has fewer new tokens than the longest
            return
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        first_pos = seq_len - q_len  # position of the sequence's first new token

        r = tl.arange(0, BLOCK_M)
        tok = qt * BLOCK_Q + r // GROUP_PAD
        g = r % GROUP_PAD
        heads = kvh * GROUP + g
        d = tl.arange(0, BLOCK_D)
        row_ok = (tok < q_len) & (g < GROUP)
        rd_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
        rows = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=rd_mask,
            other=0.0,
        )
        q_pos = first_pos + tok
        # Keys this tile needs: the cached prefix and the new tokens up to its last query
        # (causal), from the first query's window start.
        tile_first = first_pos + qt * BLOCK_Q
        hi = tl.minimum(tile_first + BLOCK_Q, seq_len)
        lo = 0
        if SLIDING:
            lo = tl.maximum(tile_first - window + 1, 0)
        o, m_i, l_i = _attend(
            q, q_pos, lo, hi, kvh, bt_ptr + b * stride_btb,
            k_cache_ptr, v_cache_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch, scale,
            window, SLIDING, BLOCK_SIZE, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip
        tl.store(
            out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=rd_mask,
        )


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            "the triton attention backend needs the `triton` package: pip install triton "
            "(or choose another attention backend)"
        )


def _check_layout(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> tuple[int, int]:
    """Validates the shared inputs of the attention launchers; returns (group, head_dim)."""
    _require_triton()
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [tokens, heads, head_dim] and k_cache == v_cache shapes "
            f"[num_blocks * block_size, kv_heads, head_dim]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim of q ({head_dim}) and cache ({k_cache.shape[2]}) must match and be at "
            f"most {MAX_HEAD_DIM}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q and the caches must share one dtype of {_DTYPES}; got q {q.dtype}, k_cache "
            f"{k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if block_size < 1 or k_cache.shape[0] % block_size:
        raise ValueError(
            f"cache rows ({k_cache.shape[0]}) must be a multiple of block_size ({block_size})"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks] with one row per seq_lens entry; got "
            f"{tuple(block_tables.shape)} for {seq_lens.shape[0]} sequences"
        )
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError("block_tables and seq_lens must be int32 or int64 tensors")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (call .contiguous())")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")
    return num_heads // num_kv_heads, head_dim


def _dot_precision(q: torch.Tensor) -> str:
    # float32 dots in IEEE (Triton's default is TF32, which would break the float32 token-exact
    # oracle); fp16/bf16 keep the default, the option only concerns float32 inputs.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _window(sliding_window: int | None) -> int:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return sliding_window or 0


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, KvH, D] into rows ``slot_mapping`` [T] (int32/int64; -1 = skip) of the
    caches [num_slots, KvH, D]. One launch, T x KvH programs."""
    _require_triton()
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"key and value must be [tokens, kv_heads, head_dim] matching the cache's "
            f"{tuple(k_cache.shape[1:])}; got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if k_cache.shape != v_cache.shape or slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match and "
            f"slot_mapping {tuple(slot_mapping.shape)} must hold one slot per token"
        )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (call .contiguous())")
    if key.shape[0] == 0:
        return
    head_dim = key.shape[2]
    _write_kv_kernel[(key.shape[0], key.shape[1])](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim),
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """q [B, H, D], one new token per sequence, its K/V already written -> [B, H, D].

    Pass 1, grid (B, KvH, num_splits): each program takes 1/num_splits of the sequence's
    visible keys and writes a normalised partial output and its log-sum-exp (float32). Pass 2,
    grid (B, H): merges the splits weighted by exp(lse). ``num_splits`` defaults to
    ``choose_num_splits``; it depends on shapes only (never on seq_lens, which stay on the
    device)."""
    group, head_dim = _check_layout(q, k_cache, v_cache, block_tables, seq_lens, block_size)
    batch, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[1]
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {batch} decode rows")
    splits = choose_num_splits(batch, num_kv_heads) if num_splits is None else num_splits
    if splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(
            f"num_splits must be >= 1 ({splits}) and block_n a power of two >= 16 ({block_n})"
        )
    window = _window(sliding_window)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = max(16, _next_pow2(head_dim))
    mid_o = torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse,
        scale, window, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        SLIDING=window > 0, BLOCK_SIZE=block_size, GROUP=group,
        BLOCK_G=max(16, _next_pow2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q),
    )  # fmt: skip
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=_next_pow2(splits),
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_query_len: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """q [T, H, D], a ragged batch (see attention_ref.py), its new K/V already written ->
    [T, H, D]. One launch, grid (cdiv(max_query_len, BLOCK_Q), B, KvH) with
    BLOCK_Q = block_m // next_pow2(group) new tokens per program. ``max_query_len`` (the most
    new tokens of any sequence) comes from the host so the grid needs no device sync."""
    group, head_dim = _check_layout(q, k_cache, v_cache, block_tables, seq_lens, block_size)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got "
            f"{tuple(query_start_loc.shape)}"
        )
    group_pad = _next_pow2(group)
    if block_m & (block_m - 1) or block_m < max(16, group_pad) or block_n < 16:
        raise ValueError(
            f"block_m ({block_m}) must be a power of two >= max(16, {group_pad} heads per KV "
            f"head) and block_n ({block_n}) a power of two >= 16"
        )
    if block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    window = _window(sliding_window)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    if num_seqs == 0 or max_query_len < 1:
        return out
    block_q = block_m // group_pad
    grid = (-(-max_query_len // block_q), num_seqs, k_cache.shape[1])
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        SLIDING=window > 0, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_D=max(16, _next_pow2(head_dim)), BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q),
    )  # fmt: skip
    return out
