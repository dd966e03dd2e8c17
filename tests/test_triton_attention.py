"""The Triton attention kernels against the torch reference over the engine's paged layout.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (set below, before the
kernels module is imported: triton.jit reads it at decoration). The interpreter is slow, so the
default cases are few and small; the sweep (every pair of parameter values; every combination
with ITERSERVE_FULL_SWEEP=1) is marked slow. The interpreter's ``tl.dot`` is
wrong on bfloat16, so attention is checked in float32 and float16 (bf16 only for the KV write).
The reference itself is checked against plain SDPA and against the engine's CPU attention.
"""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from iterserve.model import attention, attention_ref  # noqa: E402
from iterserve.model import triton_attention as ta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if ta.HAS_TRITON and DEVICE == "cpu" and os.environ["TRITON_INTERPRET"] == "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(ta._write_kv_kernel, InterpretedFunction):
        # Imported earlier in this process without the interpreter: rebuild the kernels.
        ta = importlib.reload(ta)

needs_triton = pytest.mark.skipif(
    not ta.HAS_TRITON, reason="triton is not installed: pip install triton (see pyproject dev)"
)

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


@dataclass
class Batch:
    """One step's ragged batch over a paged cache, as the engine lays it out."""

    q: torch.Tensor  # [T, H, D], rows grouped by sequence
    new_k: torch.Tensor  # [T, KvH, D]: the step's new K/V, not yet in the cache
    new_v: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    k_cache: torch.Tensor  # [num_blocks * block_size, KvH, D], random (stale) everywhere
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    block_size: int


def make_batch(
    specs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    """``specs``: (cached positions, new tokens) per sequence. Blocks are handed out in a
    shuffled order so no sequence's blocks are contiguous."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    nblocks = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(nblocks) + 2  # spare blocks hold stale data no sequence may read
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, used = [], [], 0
    for (c, n), nb in zip(specs, nblocks):
        table = perm[used : used + nb]
        used += nb
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        tables.append(table + [0] * (max(nblocks) - nb))
    T = sum(n for _, n in specs)
    starts = [0, *itertools.accumulate(n for _, n in specs)]

    def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return Batch(
        q=randn(T, num_kv_heads * group, head_dim),
        new_k=randn(T, num_kv_heads, head_dim),
        new_v=randn(T, num_kv_heads, head_dim),
        slot_mapping=ints(slots),
        k_cache=randn(num_blocks * block_size, num_kv_heads, head_dim),
        v_cache=randn(num_blocks * block_size, num_kv_heads, head_dim),
        block_tables=ints(tables),
        query_start_loc=ints(starts),
        seq_lens=ints([c + n for c, n in specs]),
        max_query_len=max(n for _, n in specs),
        block_size=block_size,
    )


def write_both(b: Batch) -> None:
    """Writes the new K/V with the kernel into b's caches and with the reference into copies,
    and asserts that both caches agree."""
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    attention_ref.write_kv_cache(b.new_k, b.new_v, k_ref, v_ref, b.slot_mapping)
    ta.write_kv_cache(b.new_k, b.new_v, b.k_cache, b.v_cache, b.slot_mapping)
    assert torch.equal(b.k_cache, k_ref) and torch.equal(b.v_cache, v_ref)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------- the reference is trustworthy


@pytest.mark.parametrize(
    ("group", "window", "cached", "new"),
    [(1, None, 0, 9), (4, None, 23, 6), (4, 5, 23, 6), (2, 7, 0, 12), (8, None, 40, 1)],
)
def test_reference_matches_sdpa_on_unpaged_tensors(
    group: int, window: int | None, cached: int, new: int
) -> None:
    b = make_batch([(cached, new)], 2, group, 32, 16, torch.float32, seed=group)
    attention_ref.write_kv_cache(b.new_k, b.new_v, b.k_cache, b.v_cache, b.slot_mapping)
    out = attention_ref.paged_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, 16,
        sliding_window=window,
    )  # fmt: skip

    # The same sequence as plain contiguous tensors: gather its positions in order.
    ctx = cached + new
    pos = torch.arange(ctx, device=DEVICE)
    slots = b.block_tables[0, pos // 16].long() * 16 + pos % 16
    k, v = b.k_cache[slots], b.v_cache[slots]  # [ctx, KvH, D]
    assert torch.equal(k[cached:], b.new_k)
    q_pos = torch.arange(cached, ctx, device=DEVICE)[:, None]
    allowed = pos[None, :] <= q_pos
    if window is not None:
        allowed &= pos[None, :] > q_pos - window
    expected = F.scaled_dot_product_attention(
        b.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed,
        enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_engine_attention(window: int | None) -> None:
    """Same layout as the engine: attention.paged_attention (the CPU path, decode-first rows)
    over the same cache, block tables and slots gives the reference's output."""
    specs = [(17, 1), (3, 1), (0, 11), (21, 7)]  # two decodes first, as the runner orders rows
    b = make_batch(specs, 2, 4, 32, 16, torch.float32, seed=3)
    if DEVICE != "cpu":
        pytest.skip("the engine's attention path is the CPU one")
    tables = b.block_tables.tolist()
    items = [attention.StepItem(n, c, tables[i]) for i, (c, n) in enumerate(specs)]
    meta = attention.build_attention_metadata(items, 2, 16, window, torch.float32)
    assert meta.slot_mapping.tolist() == b.slot_mapping.tolist()
    k_eng, v_eng = b.k_cache.clone(), b.v_cache.clone()
    engine_out = attention.paged_attention(b.q, b.new_k, b.new_v, k_eng, v_eng, meta, 16)

    attention_ref.write_kv_cache(b.new_k, b.new_v, b.k_cache, b.v_cache, b.slot_mapping)
    assert torch.equal(b.k_cache, k_eng) and torch.equal(b.v_cache, v_eng)
    out = attention_ref.paged_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, 16,
        sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(out.reshape(len(b.q), -1), engine_out, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- kernels vs the reference


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_skips_padding_slots(dtype: torch.dtype, block_size: int) -> None:
    b = make_batch([(5, 3), (0, 4)], 2, 1, 80, block_size, dtype)
    b.slot_mapping[[1, 5]] = -1  # padding rows: their slots keep the stale values
    before = b.k_cache.clone()
    write_both(b)
    written = b.slot_mapping[b.slot_mapping >= 0].long()
    assert torch.equal(b.k_cache[written], b.new_k[b.slot_mapping >= 0])
    untouched = torch.ones(len(before), dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(b.k_cache[untouched], before[untouched])


# (head_dim, KV heads, GQA group, block_size, dtype, sliding window, num_splits)
DECODE_CASES = [
    (64, 2, 1, 16, torch.float32, None, 4),
    (80, 1, 4, 32, torch.float16, None, 2),
    (96, 1, 8, 16, torch.float32, None, 3),
    (128, 2, 4, 32, torch.float32, 10, 2),
    (256, 1, 1, 16, torch.float16, None, 1),
    (64, 1, 8, 16, torch.float16, 24, 3),
    (64, 1, 4, 16, torch.float32, None, 16),  # more splits than some sequences have keys
]
DECODE_SPECS = [(40, 1), (0, 1), (70, 1), (15, 1)]  # (cached, 1 new) per sequence


def check_decode(
    head_dim: int, kvh: int, group: int, block_size: int, dtype: torch.dtype,
    window: int | None, splits: int | None, specs: list[tuple[int, int]] = DECODE_SPECS,
) -> None:  # fmt: skip
    b = make_batch(specs, kvh, group, head_dim, block_size, dtype, seed=head_dim + group)
    write_both(b)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, block_size)
    out = ta.paged_decode_attention(*args, sliding_window=window, num_splits=splits)
    assert_close(out, attention_ref.decode_attention(*args, sliding_window=window))


@needs_triton
@pytest.mark.parametrize(
    ("head_dim", "kvh", "group", "block_size", "dtype", "window", "splits"), DECODE_CASES
)
def test_decode_matches_reference(
    head_dim: int, kvh: int, group: int, block_size: int, dtype: torch.dtype,
    window: int | None, splits: int,
) -> None:  # fmt: skip
    check_decode(head_dim, kvh, group, block_size, dtype, window, splits)


@needs_triton
def test_decode_split_count_does_not_change_the_result() -> None:
    """The two-pass reduction merges splits exactly: 1 split vs many agree to f32 rounding."""
    b = make_batch([(300, 1), (129, 1)], 1, 4, 64, 16, torch.float32, seed=7)
    write_both(b)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 16)
    one = ta.paged_decode_attention(*args, num_splits=1)
    for splits in (2, 5, 8):
        torch.testing.assert_close(ta.paged_decode_attention(*args, num_splits=splits), one)


# A ragged step: decodes, chunks after a cached prefix, fresh prompts, a 1-token fresh prompt.
PREFILL_SPECS = [(33, 1), (0, 19), (40, 9), (0, 1), (17, 1), (5, 27)]
# (head_dim, KV heads, GQA group, block_size, dtype, sliding window, block_m, block_n)
PREFILL_CASES = [
    (64, 2, 1, 16, torch.float32, None, 16, 16),
    (80, 1, 4, 32, torch.float16, None, 32, 16),
    (96, 1, 8, 16, torch.float32, None, 64, 32),
    (128, 1, 4, 32, torch.float32, 12, 32, 32),
    (256, 1, 1, 16, torch.float16, None, 16, 32),
    (64, 1, 8, 16, torch.float16, 7, 64, 16),
]


def check_prefill(
    head_dim: int, kvh: int, group: int, block_size: int, dtype: torch.dtype,
    window: int | None, block_m: int, block_n: int,
    specs: list[tuple[int, int]] = PREFILL_SPECS,
) -> None:  # fmt: skip
    b = make_batch(specs, kvh, group, head_dim, block_size, dtype, seed=head_dim * group)
    write_both(b)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens)
    out = ta.paged_prefill_attention(
        *args, block_size, b.max_query_len, sliding_window=window, block_m=block_m,
        block_n=block_n,
    )  # fmt: skip
    assert_close(out, attention_ref.paged_attention(*args, block_size, sliding_window=window))


@needs_triton
@pytest.mark.parametrize(
    ("head_dim", "kvh", "group", "block_size", "dtype", "window", "block_m", "block_n"),
    PREFILL_CASES,
)
def test_prefill_ragged_batch_matches_reference(
    head_dim: int, kvh: int, group: int, block_size: int, dtype: torch.dtype,
    window: int | None, block_m: int, block_n: int,
) -> None:  # fmt: skip
    check_prefill(head_dim, kvh, group, block_size, dtype, window, block_m, block_n)


@needs_triton
def test_prefill_kernel_runs_decodes_as_one_token_sequences() -> None:
    b = make_batch(DECODE_SPECS, 1, 4, 64, 16, torch.float32, seed=11)
    write_both(b)
    cache = (b.k_cache, b.v_cache, b.block_tables)
    decode = ta.paged_decode_attention(b.q, *cache, b.seq_lens, 16, num_splits=2)
    prefill = ta.paged_prefill_attention(b.q, *cache, b.query_start_loc, b.seq_lens, 16, 1)
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


@needs_triton
def test_launchers_reject_bad_inputs_with_the_fix() -> None:
    b = make_batch([(3, 2)], 2, 2, 64, 16, torch.float32)
    cache = (b.k_cache, b.v_cache, b.block_tables)
    with pytest.raises(ValueError, match="share one dtype"):
        ta.paged_decode_attention(b.q[:1].half(), *cache, b.seq_lens, 16)
    with pytest.raises(ValueError, match="not a multiple of"):
        ta.paged_decode_attention(b.q[:1, :1].repeat(1, 3, 1), *cache, b.seq_lens, 16)
    with pytest.raises(ValueError, match="at most 256"):
        big = torch.zeros(1, 2, 512, device=DEVICE)
        ta.paged_decode_attention(big, big, big, b.block_tables, b.seq_lens, 1)
    with pytest.raises(ValueError, match="multiple of block_size"):
        ta.paged_decode_attention(b.q[:1], *cache, b.seq_lens, 20)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        ta.paged_decode_attention(b.q[:1], *cache, b.seq_lens, 16, sliding_window=0)
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        ta.paged_prefill_attention(b.q, *cache, b.seq_lens, b.seq_lens, 16, 2)
    with pytest.raises(ValueError, match="block_m"):
        ta.paged_prefill_attention(b.q, *cache, b.query_start_loc, b.seq_lens, 16, 2, block_m=48)
    with pytest.raises(ValueError, match="one slot per token"):
        ta.write_kv_cache(b.new_k, b.new_v, b.k_cache, b.v_cache, b.slot_mapping[:1])


def test_choose_num_splits_fills_the_gpu_from_shapes_only() -> None:
    assert ta.choose_num_splits(1, 8) == 16  # 8 programs: split each sequence 16 ways (cap)
    assert ta.choose_num_splits(32, 8) == 2
    assert ta.choose_num_splits(256, 8) == 1  # the batch alone fills the SMs


# ---------------------------------------------------------------- they compile for a GPU


def compile_for_sm90(dtype: str, head_dim: int, sliding: bool) -> None:
    """Compiles every kernel to an sm_90 (H100/H200) cubin, which needs no GPU: catches what the
    interpreter cannot (layout, tl.dot shape and register lowering). Run in a process where
    TRITON_INTERPRET=0, so the kernels are JIT functions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    block_d = max(16, 1 << (head_dim - 1).bit_length())
    dot = "ieee" if dtype == "fp32" else "tf32"
    tile = dict(SLIDING=sliding, BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=64)
    kernels = [
        (ta._write_kv_kernel, dict(HEAD_DIM=head_dim, BLOCK_D=block_d)),
        (ta._decode_split_kernel, dict(tile, GROUP=8, BLOCK_G=16, DOT_PRECISION=dot)),
        (ta._decode_reduce_kernel, dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=16)),
        (ta._prefill_kernel, dict(tile, GROUP=4, GROUP_PAD=4, BLOCK_Q=16, BLOCK_M=64,
                                  DOT_PRECISION=dot)),
    ]  # fmt: skip
    index_ptrs = ("bt_ptr", "seq_lens_ptr", "qsl_ptr", "slot_ptr")
    for fn, consts in kernels:
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in index_ptrs:
                sig[name] = "*i32"
            elif name.startswith("mid_"):
                sig[name] = "*fp32"
            elif name.endswith("_ptr"):
                sig[name] = f"*{dtype}"
            else:
                sig[name] = "fp32" if name == "scale" else "i32"
        binary = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
        assert binary.asm["cubin"], fn.__name__


def run_compile_check(cases: list[tuple[str, int, bool]]) -> None:
    calls = "; ".join(f"t.compile_for_sm90({d!r}, {h}, {w})" for d, h, w in cases)
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    code += f"import test_triton_attention as t; {calls}"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_triton
def test_kernels_compile_for_sm90_in_bf16() -> None:
    run_compile_check([("bf16", 80, False)])


@needs_triton
@pytest.mark.slow
def test_kernels_compile_for_sm90_every_dtype_and_head_size() -> None:
    run_compile_check([("fp16", 64, True), ("fp16", 128, False), ("bf16", 96, True),
                       ("bf16", 256, True), ("fp32", 64, False), ("fp32", 256, True)])  # fmt: skip


# ---------------------------------------------------------------- the full sweep

SWEEP_AXES: list[list[object]] = [
    [64, 80, 96, 128, 256],  # head_dim (80 and 96 pad to a power of two)
    [1, 4, 8],  # query heads per KV head
    [16, 32],  # block_size
    [torch.float32, torch.float16],
    [None, 13],  # sliding window
]


def pairwise(axes: list[list[object]]) -> list[tuple[object, ...]]:
    """Cases of the product that hold every pair of values of any two axes at least once
    (greedy: each case, from the whole product in order, covers the most pairs not yet held).
    In the interpreter the full product (120 cases) took ~3 of the suite's 12 minutes on 2
    cores (a Zen 3: 720 s before, 550 s with these 15)."""
    n = len(axes)

    def pairs(case: tuple[object, ...]) -> set[tuple[int, int, int, int]]:
        idx = [axes[a].index(case[a]) for a in range(n)]
        return {(a, idx[a], b, idx[b]) for a in range(n) for b in range(a + 1, n)}

    product = list(itertools.product(*axes))
    todo = set().union(*(pairs(c) for c in product))
    cases = []
    while todo:
        best = max(product, key=lambda c: len(pairs(c) & todo))
        cases.append(best)
        todo -= pairs(best)
    return cases


# ITERSERVE_FULL_SWEEP=1: every combination (for work on the kernels; a few minutes here)
SWEEP = (
    list(itertools.product(*SWEEP_AXES))
    if os.environ.get("ITERSERVE_FULL_SWEEP") == "1"
    else pairwise(SWEEP_AXES)
)


def test_the_sweep_holds_every_pair_of_values() -> None:
    cases = pairwise(SWEEP_AXES)
    for a, b in itertools.combinations(range(len(SWEEP_AXES)), 2):
        held = {(c[a], c[b]) for c in cases}
        assert held == set(itertools.product(SWEEP_AXES[a], SWEEP_AXES[b]))
    assert len(cases) < len(list(itertools.product(*SWEEP_AXES))) // 4


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize(("head_dim", "group", "block_size", "dtype", "window"), SWEEP)
def test_sweep_decode_and_prefill(
    head_dim: int, group: int, block_size: int, dtype: torch.dtype, window: int | None
) -> None:
    check_decode(head_dim, 1, group, block_size, dtype, window, None)
    check_prefill(head_dim, 1, group, block_size, dtype, window, 64, 32)
