"""iterserve's C++ CPU kernels (iterserve/model/kernels.py): the bf16 panel GEMM against torch,
the build's caching and errors, the on/off setting. The paged decode kernel is tested against
SDPA in test_model.py, and end to end by every token-exact engine test."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import kernels


def _kern() -> kernels.Kernels:
    kern = kernels.load()
    assert kern is not None, "the C++ kernels did not build (see the warning logged)"
    return kern


def _each_thread_count(counts: tuple[int, ...]) -> Iterator[int]:
    """Sets torch's (and so the kernels') thread count to each of ``counts`` in turn, then back."""
    threads = torch.get_num_threads()
    try:
        for nt in counts:
            torch.set_num_threads(nt)
            yield nt
    finally:
        torch.set_num_threads(threads)


def avx2_kernels() -> kernels.Kernels:
    """The kernels as a CPU with AVX2 + FMA but no AVX-512 runs them (their 8-lane paths), built
    here with -mno-avx512f (cached beside the usual build), so an AVX-512 machine tests those
    paths too."""
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split() for ln in f if ln.startswith("flags")), [])
    if not {"avx2", "fma"} <= set(flags):
        pytest.skip("the AVX2 paths need a CPU with AVX2 and FMA")
    return _avx2_build()


@functools.lru_cache(maxsize=1)
def _avx2_build() -> kernels.Kernels:
    return kernels.Kernels(kernels.build(extra_flags=("-mno-avx512f",)))


@pytest.fixture(params=["native", "avx2"])
def kern_variant(request: pytest.FixtureRequest) -> kernels.Kernels:
    """The kernels built for this CPU, and their AVX2 build."""
    return _kern() if request.param == "native" else avx2_kernels()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [48, 41, 300])
def test_panel_gemm_matches_torch(
    x_dtype: torch.dtype, K: int, kern_variant: kernels.Kernels
) -> None:
    """Every row-block size (14, 8, 4, 2, 1 with AVX-512; 6, 4, 3, 2, 1 with AVX2; their mixes), N
    not a multiple of the 32-column panel, K not a multiple of the k-unrolling, K over more than
    two of the AVX2 kernel's 128-line f32 chunks, with and without bias."""
    kern = kern_variant
    torch.manual_seed(0)
    for M in (1, 2, 3, 5, 8, 9, 14, 15, 17, 22, 32, 33, 35, 70):
        for N in (37, 64):
            x = torch.randn(M, K).to(x_dtype)
            w = torch.randn(N, K).bfloat16()
            b = torch.randn(N).to(x_dtype)
            panels = kern.pack_panels(w)
            assert panels.numel() == -(-N // 32) * K * 32
            ref = F.linear(x.float(), w.float(), b.float())
            for bias in (None, b):
                y = kern.gemm_panels(x, panels, N, bias)
                assert y.dtype == x_dtype and y.shape == (M, N)
                want = ref if bias is not None else ref - b.float()
                if x_dtype == torch.float32:
                    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
                else:  # f32 accumulation, one rounding to bf16 at the end
                    assert (y.float() - want).abs().max().item() <= want.abs().max().item() * 2**-8


def test_panel_gemm_checks_its_inputs() -> None:
    kern = _kern()
    with pytest.raises(ValueError, match="bf16 weight"):
        kern.pack_panels(torch.ones(3, 4))
    panels = kern.pack_panels(torch.ones(3, 4).bfloat16())
    with pytest.raises(ValueError, match="shapes do not match"):
        kern.gemm_panels(torch.ones(1, 5), panels, 3)
    with pytest.raises(ValueError, match="2-D bf16/f32 x"):
        kern.gemm_panels(torch.ones(1, 4, dtype=torch.float64), panels, 3)


def test_setting_is_checked_and_turns_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITERSERVE_KERNELS", "0")
    assert kernels.load() is None
    monkeypatch.setenv("ITERSERVE_KERNELS", "yes")
    with pytest.raises(ValueError, match="ITERSERVE_KERNELS must be 0 .*got 'yes'"):
        kernels.load()


def test_build_is_cached_and_reports_compiler_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = kernels.build(tmp_path)
    mtime = lib.stat().st_mtime_ns
    assert kernels.build(tmp_path) == lib and lib.stat().st_mtime_ns == mtime  # not rebuilt
    assert kernels.Kernels(lib).lib.iterserve_kernels_version() == 1
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(RuntimeError, match="failed to build"):
        kernels.build(tmp_path / "other")


def test_fused_bf16_elementwise_ops_equal_torch_bit_for_bit(kern_variant: kernels.Kernels) -> None:
    """RMSNorm, SwiGLU and RoPE in one call each round as the torch ops they replace (llama.py),
    bit for bit on these seeded inputs (RMSNorm's f32 sum of squares adds in another order than
    torch's, which moves a last place in about one element in 10^5 on wide-ranged inputs), vector
    and scalar paths (widths multiple of 16 and not), AVX-512 and AVX2; RoPE with a per-head
    norm first exactly as RMSNorm per head and then RoPE."""
    from iterserve.model.layers import HeadRMSNorm, apply_rope, interleave_gate_up

    kern = kern_variant
    torch.manual_seed(0)
    for n in (768, 48, 40, 36):
        x = (torch.randn(9, n) * 3).bfloat16()
        w = torch.randn(n).bfloat16()
        assert torch.equal(kern.rms_norm(x, w, 1e-6), F.rms_norm(x, (n,), None, 1e-6) * w)
        a = (torch.randn(9, n) * 3).bfloat16()
        h = x + a
        y = kern.rms_norm(x, w, 1e-6, add=a)  # x += a in place, then the norm
        assert torch.equal(x, h) and torch.equal(y, F.rms_norm(h, (n,), None, 1e-6) * w)
        gu = (torch.randn(64, 2 * n) * 4).bfloat16()
        want = F.silu(gu[:, :n]) * gu[:, n:]
        assert torch.equal(kern.silu_mul(gu), want)
        # gate and up in alternating blocks (layers.interleave_gate_up: gu's columns are the
        # product of a weight whose rows were laid out so)
        for block in (16, 8, 4):
            if n % block == 0:
                inter = interleave_gate_up(gu.T, block).T
                assert not torch.equal(inter, gu)
                assert torch.equal(kern.silu_mul(inter, block), want), (n, block)
    with pytest.raises(ValueError, match="block must be 0 or divide"):
        kern.silu_mul(torch.zeros(2, 2 * 40).bfloat16(), 16)
    for hd in (128, 64, 48, 20):
        qkv = (torch.randn(7, 5 * hd + 3) * 2).bfloat16()
        x = qkv[:, : 4 * hd].view(7, 4, hd)  # a strided view, as in the layer
        cos, sin = torch.randn(7, 1, hd).bfloat16(), torch.randn(7, 1, hd).bfloat16()
        assert torch.equal(kern.rope(x, cos, sin), apply_rope(x, cos, sin))
        # Qwen3's per-head q / k norm in the same call (a weight row per head, as the loader
        # broadcasts q_norm and k_norm): rms_norm's arithmetic per head, then RoPE, the same
        # bits; against torch's norm (its f32 sum of squares in another order) the same but
        # for rare last-place differences
        norm = HeadRMSNorm(torch.randn(4, hd).bfloat16(), 1e-6)
        got = kern.rope(x, cos, sin, norm.weight, 1e-6)
        heads = [kern.rms_norm(x[:, i].contiguous(), norm.weight[i], 1e-6) for i in range(4)]
        assert torch.equal(got, apply_rope(torch.stack(heads, 1), cos, sin))
        ref = apply_rope(norm(x), cos, sin)
        assert (got != ref).sum() <= 2
        assert (got.float() - ref.float()).abs().max() <= 2**-6 * ref.float().abs().max()
    with pytest.raises(ValueError, match="rms_norm takes bf16"):
        kern.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="norm"):  # one weight row per head
        kern.rope(x, cos, sin, torch.ones(3, 20).bfloat16(), 1e-6)


def test_argmax_equals_torch(kern_variant: kernels.Kernels) -> None:
    """First index on ties, a NaN counts as the largest, rows shorter than a vector."""
    kern = kern_variant
    torch.manual_seed(0)
    for x in (torch.randn(33, 32000), torch.randint(0, 5, (40, 37)).float(), torch.randn(3, 7)):
        assert torch.equal(kern.argmax(x), x.argmax(-1))
    x = torch.randn(5, 100)
    x[1, 50] = x[2, 3] = x[2, 90] = x[4, 99] = x[0, 27] = float("nan")
    x[3, :] = float("-inf")
    assert torch.equal(kern.argmax(x), x.argmax(-1))


_M32 = 0xFFFFFFFF


def _philox4x32_10(c: tuple[int, ...], k0: int, k1: int) -> list[int]:
    """Philox4x32-10 in plain Python, from the paper's definition (Salmon et al., SC'11)."""
    w = list(c)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * w[0], 0xCD9E8D57 * w[2]
        w = [(p1 >> 32) ^ w[1] ^ k0, p1 & _M32, (p0 >> 32) ^ w[3] ^ k1, p0 & _M32]
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return w


def _unit(words: list[int]) -> list[float]:
    """philox_unit: min((w + 1/2) / 2^32, 1 - 2^-24), each step an f32 operation."""
    w = torch.tensor(words, dtype=torch.int64).to(torch.float32)
    v = (w + 0.5) * 2.0**-32
    return torch.minimum(v, torch.tensor(1.0 - 2.0**-24)).tolist()


def test_philox_uniform_is_the_reference_stream(kern_variant: kernels.Kernels) -> None:
    """The sampler's uniforms: Philox4x32-10 (checked against Random123's known answers), word
    (j % 64) // 16 of counter j // 64 * 16 + j % 16 as min((w + 1/2) / 2^32, 1 - 2^-24) in f32,
    never 0 or 1 (-log(1 - v) then is finite and positive: an infinite noise once made a row
    whose one allowed token drew it return token 0); a row alone equals the same row in a
    batch; a vocabulary that is not a multiple of 64."""
    kat = [
        ((0, 0, 0, 0), (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ((_M32,) * 4, (_M32, _M32), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        ),
    ]
    for c, (k0, k1), want in kat:
        assert _philox4x32_10(c, k0, k1) == want
    kern = kern_variant
    keys = torch.tensor([0, 1, -1, 0x0123456789ABCDEF, -(2**63)], dtype=torch.int64)
    u = kern.uniform(keys, 200)
    for r, key in enumerate(keys.tolist()):
        k = key % 2**64
        words = [
            _philox4x32_10((j // 64 * 16 + j % 16, 0, 0, 0), k & _M32, k >> 32)[j % 64 // 16]
            for j in range(200)
        ]
        assert u[r].tolist() == _unit(words), key
    assert torch.equal(kern.uniform(keys[3:4], 200), u[3:4])
    assert 0.0 < u.min() and u.max() < 1.0
    lo, hi = _unit([0, _M32])
    assert lo == 2.0**-33 and hi == 1.0 - 2.0**-24  # the extreme words stay inside (0, 1)
    assert kern.uniform(keys, 0).shape == (5, 0)
    with pytest.raises(ValueError, match="int64 keys"):
        kern.uniform(keys.int(), 3)


def _race_reference(
    logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, kern: kernels.Kernels
) -> torch.Tensor:
    """Each row's scores of the exponential race in f64: logits / T - log(-log1p(-v)) on the
    kernels' uniforms (checked above against the reference stream)."""
    v = kern.uniform(keys, logits.shape[1]).double()
    return logits.double() / temps.double().unsqueeze(1) - torch.log(-torch.log1p(-v))


def _assert_race(
    kern: kernels.Kernels, logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """The kernel's tokens are the f64 reference's argmax, or (rounding) within 1e-5 of it."""
    got = kern.race(logits, temps, keys)
    score = _race_reference(logits, temps, keys, kern)
    best = score.max(-1).values
    picked = score.gather(1, got.unsqueeze(1)).squeeze(1)
    assert torch.all(best - picked <= 1e-5), (best - picked).max()
    return got


def test_race_is_the_exponential_race_on_the_stream(kern_variant: kernels.Kernels) -> None:
    """philox_race: the first index of the largest logits / T - log(E), E = -log(1 - v) of the
    Philox uniforms, in one pass; unlikely tokens (e^-12 of the top: won only where E ~ 1e-6,
    the resolution the noise keeps near 0) drawn as the reference draws them; vocabularies
    that are not a multiple of 16; -inf never wins; a row alone equals the same row in a
    batch. AVX-512 only: the AVX2 build says so."""
    kern = kern_variant
    keys = torch.randint(-(2**63), 2**63 - 1, (600,), generator=torch.Generator().manual_seed(1))
    if not kern.has_race:
        with pytest.raises(RuntimeError, match="AVX-512"):
            kern.race(torch.zeros(1, 4), torch.ones(1), keys[:1])
        return
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 64, 100, 1000, 49152):
        rows = 8 if n > 1000 else 40
        logits = torch.randn(rows, n, generator=g) * 3
        temps = torch.rand(rows, generator=g) * 1.5 + 0.1
        got = _assert_race(kern, logits, temps, keys[:rows])
        assert torch.equal(kern.race(logits[3:4], temps[3:4], keys[3:4]), got[3:4])
    # the tail: one token at 0, 4,095 at -12 (a row's tail mass ~2.5%)
    logits = torch.full((600, 4096), -12.0)
    logits[:, 5] = 0.0
    got = _assert_race(kern, logits, torch.ones(600), keys)
    assert int((got != 5).sum()) >= 5  # the reference's rare draws happen, and match
    # masked tokens: a row with one allowed token draws it, a row of -inf gives 0
    logits = torch.full((3, 300), float("-inf"))
    logits[0, 299] = logits[1, 17] = 4.0
    assert kern.race(logits, torch.ones(3), keys[:3]).tolist() == [299, 17, 0]
    with pytest.raises(ValueError, match="int64 keys"):
        kern.race(logits, torch.ones(3), keys[:3].int())


def test_top_p_floor_is_the_last_token_of_the_nucleus(kern_variant: kernels.Kernels) -> None:
    """top_p_floor: the value of the last token a sort keeps (largest first, while the mass
    before it is below top_p) and how many tokens equal to it the cut keeps, against an f64
    sort of the softmax, over rows from flat (nuclei of ~50,000 tokens) to peaked (one
    token), rows of bf16 values (ties at the cut), -inf rows and top_p 1; +inf and NaN rows
    give a floor without crashing; the race with those floors and ties only draws tokens the
    sort keeps."""
    kern = kern_variant
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 2.0, 4.0, 8.0):
        x = torch.randn(32, 49152 if scale == 0.3 else 3001, generator=g) * scale
        x[16:] = x[16:].bfloat16().float()  # many equal values
        tp = torch.rand(32, generator=g) * 0.98 + 0.01
        tp[0] = 1.0
        x[1, :] = float("-inf")
        x[2, 100:] = float("-inf")  # a masked row: the nucleus is among the first 100
        srt = x.double().sort(-1, descending=True).values
        p = srt.softmax(-1)
        kept = ((p.cumsum(-1) - p) < tp.double().unsqueeze(1)).sum(-1, keepdim=True)
        want = srt.gather(1, (kept - 1).clamp(min=0)).float()
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        want_ties = ((srt.float() == want) & (pos < kept)).sum(-1).int()
        want, want_ties = want.squeeze(1), want_ties
        want[:2], want_ties[:2] = float("-inf"), -1
        got, ties = kern.top_p_floor(x, tp)
        assert torch.equal(got, want), (scale, (got != want).nonzero().flatten().tolist())
        assert torch.equal(ties, want_ties), (scale, (ties != want_ties).nonzero().flatten())
        if kern.has_race:
            keys = torch.arange(30, dtype=torch.int64)
            tokens = kern.race(x[2:], torch.ones(30), keys, got[2:], ties[2:])
            picked = x[2:].gather(1, tokens.unsqueeze(1)).squeeze(1)
            assert bool((picked >= got[2:]).all())
    odd = torch.randn(3, 500, generator=g)
    odd[0, 7], odd[1, :], odd[2, 9] = float("inf"), float("nan"), float("nan")
    got, ties = kern.top_p_floor(odd, torch.full((3,), 0.9))
    assert got[0] == float("inf") and got[1] == float("-inf") and ties[:2].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="top_p_floor takes"):
        kern.top_p_floor(torch.zeros(2, 3), torch.ones(3))


def test_top_k_values_are_torchs_topk(kern_variant: kernels.Kernels) -> None:
    """top_k_values: for the chosen rows, each one's k largest values largest first, equal to
    torch.topk's, then -inf to the widest k; rows of every length (k blocks or fewer), k from
    1 to n, bf16 rows (ties), -inf rows and partly masked rows, a NaN (the largest, as
    torch's) and +inf; a row chosen twice; bad rows or k refused."""
    kern = kern_variant
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 100, 1000, 3001, 49152):
        x = torch.randn(10, n, generator=g) * 4
        x[3, :] = float("-inf")
        x[4, ::3] = float("-inf")
        x[5] = x[5].bfloat16().float().round()  # few distinct values: ties everywhere
        if n > 4:
            x[6, 2] = float("nan")
            x[7, -1] = float("inf")
        for k in sorted({1, 2, 7, 50, n // 2 + 1, n}):
            if k > n:
                continue
            rows = torch.tensor([0, 3, 4, 5, 6, 7, 8, 9, 9], dtype=torch.int64)
            ks = torch.full((9,), k, dtype=torch.int32)
            ks[6] = 1
            out = kern.top_k_values(x, rows, ks)
            assert out.shape == (9, k)
            for i, (r, q) in enumerate(zip(rows.tolist(), ks.tolist())):
                want = x[r].topk(q).values
                assert torch.equal(out[i, :q].nan_to_num(nan=7e7), want.nan_to_num(nan=7e7)), (
                    n, k, r,
                )  # fmt: skip
                assert bool((out[i, q:] == float("-inf")).all())
    assert kern.top_k_values(x, torch.zeros(0, dtype=torch.int64), ks[:0]).shape == (0, 0)
    with pytest.raises(ValueError, match="ks in 1.."):
        kern.top_k_values(x, rows, torch.full((9,), n + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows must be in"):
        kern.top_k_values(x, rows + 10, ks)
    with pytest.raises(ValueError, match="int32 ks"):
        kern.top_k_values(x, rows, ks.long())


def test_race_keeps_the_first_ties_at_the_floor_and_refuses_bad_temperatures() -> None:
    """Of the tokens equal to the floor only the first ``ties`` by index can win (a sort's cut
    keeps a count of them: top-k exactly k); a tiny temperature still splits a tie evenly
    (the scores are taken relative to the row's max, so f32 steps of a huge l / T do not
    round the noise away); temperatures must be finite and > 0."""
    kern = _kern()
    if not kern.has_race:
        pytest.skip("the race kernel is AVX-512 only")
    x = torch.full((2000, 40), -5.0)
    x[:, [3, 10, 17, 30]] = 2.0  # four tokens tied at the floor
    keys = torch.arange(2000, dtype=torch.int64)
    floors = torch.full((2000,), 2.0)
    for budget, allowed in ((1, {3}), (2, {3, 10}), (-1, {3, 10, 17, 30})):
        ties = torch.full((2000,), budget, dtype=torch.int32)
        assert set(kern.race(x, torch.ones(2000), keys, floors, ties).tolist()) == allowed
    pair = torch.full((20000, 8), -100.0)
    pair[:, 2] = pair[:, 5] = 80.0  # l / T = 8e6 at T = 1e-5, where f32 steps by 1
    keys = torch.arange(20000, dtype=torch.int64)
    first = float((kern.race(pair, torch.full((20000,), 1e-5), keys) == 2).double().mean())
    assert abs(first - 0.5) < 0.015, first  # sd 0.0035
    with pytest.raises(ValueError, match="finite temperatures"):
        kern.race(pair[:2], -torch.ones(2), keys[:2])


def _prefill_case(
    n: int, p0: int, H: int, kvh: int, hd: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, H, hd] as a strided view (the layer's qk tensor), bf16 caches with the chunk's
    blocks scattered, the f32 SDPA reference [n, H * hd] over the gathered keys, and torch's
    bf16 SDPA on the same values (the yardstick of a bf16 kernel's error)."""
    g = torch.Generator().manual_seed(seed)
    bs, ctx = 4, p0 + n
    nblocks = -(-ctx // bs) + 5
    k_cache = (torch.randn(nblocks * bs, kvh, hd, generator=g) * 2).bfloat16()
    v_cache = torch.randn(nblocks * bs, kvh, hd, generator=g).bfloat16()
    table = torch.randperm(nblocks, generator=g)[: -(-ctx // bs)].contiguous()
    q = torch.randn(n, H + kvh, hd, generator=g).bfloat16()[:, :H]
    k, v = (c.view(-1, bs, kvh, hd)[table].reshape(-1, kvh, hd)[:ctx] for c in (k_cache, v_cache))
    mask = torch.full((n, ctx), float("-inf")).triu_(p0 + 1)
    ref, low = (
        F.scaled_dot_product_attention(
            q.to(dt).transpose(0, 1), k.to(dt).transpose(0, 1), v.to(dt).transpose(0, 1),
            attn_mask=mask.to(dt), enable_gqa=kvh != H,
        ).transpose(0, 1).reshape(n, H * hd)
        for dt in (torch.float32, torch.bfloat16)
    )  # fmt: skip
    return q, k_cache, v_cache, table, ref, low


def test_prefill_attention_matches_sdpa(kern_variant: kernels.Kernels) -> None:
    """iterserve's causal prefill kernel over the paged cache against f32 SDPA: fresh prompts
    and continued chunks, rows not a multiple of the row tile or the task (4 / 64 rows with
    AVX512-BF16, 6 / 96 with AVX2, 16 on AMX tiles), chunks that start and end
    inside 32- and 64-key blocks, contexts past several of them, GQA, head_dim 64 and 128; within
    bf16 rounding of P (torch's own bf16 SDPA is the yardstick), and of the output alone for the
    f32 (AVX2) kernel."""
    kern = kern_variant
    if not kern.has_prefill_kernel:
        pytest.skip("compiled in only where the CPU has AVX512-BF16, or AVX2 without AVX-512")
    for n, p0, H, kvh, hd in [
        (1, 0, 4, 4, 64), (5, 0, 4, 2, 64), (67, 3, 4, 4, 64), (130, 61, 6, 2, 64),
        (33, 31, 2, 2, 64), (16, 48, 2, 1, 64),
        (64, 200, 2, 1, 128), (9, 0, 4, 1, 128), (37, 45, 4, 2, 128),
    ]:  # fmt: skip
        q, k_cache, v_cache, table, ref, low = _prefill_case(n, p0, H, kvh, hd, seed=n + p0)
        out = kern.paged_prefill_attention(q, k_cache, v_cache, table, p0, 4)
        assert out.dtype == torch.bfloat16 and out.shape == (n, H * hd)
        err = (out.float() - ref).abs().max().item()
        assert err < 0.03, (n, p0, H, kvh, hd, err)
        if kern.has_bf16_dot and not kern.has_amx:
            # P rounded to bf16 (from exp2_bf16): on average within 1.5x torch's bf16 SDPA's
            # error (1.10-1.37x on these cases, with exp2_bf16 as with the degree-5 2^x before
            # it; a 2^x one term short, ~0.5% off, adds 30-50%)
            mean, yard = ((o.float() - ref).abs().mean().item() for o in (out, low))
            assert mean <= 1.5 * yard, (n, p0, H, kvh, hd, mean, yard)
        if not kern.has_bf16_dot:  # the f32 kernel keeps P in f32: one rounding of the output
            assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all(), (n, p0, hd)
        # the first query sees key 0 alone: its output is that key's V, exactly
        if p0 == 0:
            v0 = v_cache.view(-1, 4, kvh, hd)[table[0], 0]
            assert torch.equal(out[0].view(H, hd), v0.repeat_interleave(H // kvh, 0))


def test_prefill_attention_leaves_denormals_on_for_torch(kern_variant: kernels.Kernels) -> None:
    """The prefill kernel flushes denormals only inside its own threads' work: afterwards torch's
    float math on the calling thread still produces them (a leaked MXCSR flag would turn 1e-39
    into 0 for everything the process computes next)."""
    kern = kern_variant
    if not kern.has_prefill_kernel:
        pytest.skip("compiled in only where the CPU has AVX512-BF16, or AVX2 without AVX-512")
    q, k_cache, v_cache, table, ref, _ = _prefill_case(70, 0, 4, 2, 64, seed=3)
    out = kern.paged_prefill_attention(q, k_cache, v_cache, table, 0, 4)
    assert (out.float() - ref).abs().max().item() < 0.03
    tiny = torch.tensor([1e-38], dtype=torch.float32) / 16  # 6.25e-40: a denormal
    assert tiny.item() > 0 and (tiny * 2).item() > 0


@pytest.mark.parametrize("hd", [64, 128])
def test_prefill_attention_when_the_row_max_rises_slowly_and_jumps(
    kern_variant: kernels.Kernels, hd: int
) -> None:
    """Scores that climb ~2 (base-2 units) every 64-key block, then one key far above the rest:
    the kernel lets a row's max lag behind by up to a fixed margin and raises it only past that
    (so most blocks skip the horizontal max and the rescale); the result must still be the exact
    softmax's, within bf16 rounding of P. At head_dim 128 on AMX tiles the second half of O
    replays the first half's rescales."""
    kern = kern_variant
    if not kern.has_prefill_kernel:
        pytest.skip("compiled in only where the CPU has AVX512-BF16, or AVX2 without AVX-512")
    g = torch.Generator().manual_seed(7)
    n, H, bs = 700, 2, 4
    nblocks = -(-n // bs)
    # q = 8 d + noise and k_j = a_j d + noise for a unit d: with scale 1/8 a score is ~a_j, so
    # a_j = j / 46 climbs 2 in log2 units (x 1.44) per 64 keys; key 650 (a = 200) towers over all:
    # 2^(200 x 1.44) overflows f32, so a row max left behind there would give inf, not V
    d = torch.randn(hd, generator=g)
    d = d / d.norm()
    q = torch.randn(n, H, hd, generator=g) * 0.1 + 8 * d
    a = torch.arange(n, dtype=torch.float32) * 2 / 64 / 1.4427
    a[650] = 200.0
    k = torch.randn(n, 1, hd, generator=g) * 0.1 + a.view(n, 1, 1) * d
    v = torch.randn(n, 1, hd, generator=g)
    table = torch.randperm(nblocks, generator=g)
    k_cache = torch.zeros(nblocks * bs, 1, hd)
    v_cache = torch.zeros(nblocks * bs, 1, hd)
    slots = (table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nblocks))[:n]
    k_cache[slots], v_cache[slots] = k, v
    qb, kb, vb = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    mask = torch.full((n, n), float("-inf")).triu_(1)
    ref = F.scaled_dot_product_attention(
        qb.float().transpose(0, 1), kb[slots].float().transpose(0, 1).expand(H, n, hd),
        vb[slots].float().transpose(0, 1).expand(H, n, hd), attn_mask=mask,
    ).transpose(0, 1).reshape(n, H * hd)  # fmt: skip
    out = kern.paged_prefill_attention(qb, kb, vb, table, 0, bs)
    err = (out.float() - ref).abs().max().item()
    assert err < 0.03, err
    # past the towering key every row is (nearly) its V
    assert (out[660:].float().view(-1, H, hd) - vb[slots[650]].float()).abs().max() < 0.03


def test_prefill_attention_with_a_key_of_huge_scores(kern_variant: kernels.Kernels) -> None:
    """A key whose scores reach ~1e10 (head_dim 64 and 128, where 1 / sqrt(128) is not a power
    of two): the row max must be exactly that key's scaled score, or 2^(t - m) for it under- or
    overflows and the row turns NaN. Every row stays finite and equal to the reference."""
    kern = kern_variant
    if not kern.has_prefill_kernel:
        pytest.skip("compiled in only where the CPU has AVX512-BF16, or AVX2 without AVX-512")
    n, bs = 140, 4
    for hd in (64, 128):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(n, 1, hd, generator=g).bfloat16()
        k = torch.randn(n, 1, hd, generator=g)
        v = torch.randn(n, 1, hd, generator=g).bfloat16()
        k[70] = 1e10
        k = k.bfloat16()
        table = torch.arange(-(-n // bs))
        k_cache = torch.zeros(len(table) * bs, 1, hd).bfloat16()
        v_cache = torch.zeros_like(k_cache)
        k_cache[:n], v_cache[:n] = k, v
        out = kern.paged_prefill_attention(q, k_cache, v_cache, table, 0, bs)
        mask = torch.full((n, n), float("-inf")).triu_(1).double()
        ref = F.scaled_dot_product_attention(
            *(t.double().transpose(0, 1) for t in (q, k, v)), attn_mask=mask
        ).transpose(0, 1).reshape(n, hd)  # fmt: skip
        assert torch.isfinite(out).all(), hd
        assert (out.double() - ref).abs().max() < 0.03, hd


def test_prefill_attention_checks_its_inputs(kern_variant: kernels.Kernels) -> None:
    kern = kern_variant
    if not kern.has_prefill_kernel:
        pytest.skip("compiled in only where the CPU has AVX512-BF16, or AVX2 without AVX-512")
    q, k_cache, v_cache, table, *_ = _prefill_case(8, 0, 2, 2, 64, seed=0)
    with pytest.raises(ValueError, match="hd a multiple of 64"):
        kern.paged_prefill_attention(q.float(), k_cache, v_cache, table, 0, 4)
    with pytest.raises(ValueError, match="covering 3 blocks"):
        kern.paged_prefill_attention(q, k_cache, v_cache, table[:1], 4, 4)


def test_write_rows_equals_index_copy() -> None:
    """The cache write from strided K / V columns, bf16 and f32, against index_copy_."""
    kern = _kern()
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for T in (0, 3, 100):
            fused = torch.randn(T, 7, 16).to(dtype)
            src = fused[:, 2:5]  # rows 7 * 16 elements apart
            slots = torch.randperm(200)[:T]
            cache, ref = torch.randn(200, 3, 16).to(dtype), None
            ref = cache.clone().index_copy_(0, slots, src)
            kern.write_rows(src, cache, slots)
            assert torch.equal(cache, ref)
    with pytest.raises(ValueError, match="do not match"):
        kern.write_rows(torch.zeros(2, 3, 8), torch.zeros(9, 3, 16), torch.zeros(2).long())


def test_pair_gemm_matches_torch() -> None:
    """iterserve's bf16 dot-product GEMM: every row tile (6, 4, 2, 1 and mixes), the row counts
    where 0, 2 or 4 tiles also prefetch the next panel (below 12, 12-23, 24 on), N not a
    multiple of the 64-column panel, odd K through ``PairLinear``'s zero column, with and
    without bias: within one bf16 rounding of the f32 result; the f32-output form gives the
    bf16 result's values exactly."""
    from iterserve.model.layers import PairLinear

    kern = _kern()
    if not kern.has_bf16_dot:
        pytest.skip("compiled in only where the CPU has AVX512-BF16")
    torch.manual_seed(0)
    for K in (48, 41):
        for M in (1, 2, 3, 5, 6, 7, 11, 12, 13, 23, 24, 29, 64):
            for N in (37, 64, 130):
                x = torch.randn(M, K).bfloat16()
                w = torch.randn(N, K).bfloat16()
                b = torch.randn(N).bfloat16()
                for bias in (None, b):
                    y = PairLinear(kern, w, bias)(x)
                    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
                    ref = F.linear(x.float(), w.float(), None if bias is None else b.float())
                    # one rounding of the f32 result: half a bf16 ulp, plus f32 summation order
                    tol = ref.abs() * 2**-8 + 1e-3
                    assert ((y.float() - ref).abs() <= tol).all(), (K, M, N)
                    # the f32-output form (the LM head's logits): the same values, exactly
                    y32 = PairLinear(kern, w, bias).f32(x)
                    assert y32.dtype == torch.float32 and torch.equal(y32, y.float()), (K, M, N)
    with pytest.raises(ValueError, match="K even"):
        kern.gemm_pairs(torch.zeros(2, 41).bfloat16(), kern.pack_pairs(w), N)


def test_amx_gemm_matches_torch() -> None:
    """The pair panels on AMX tiles: up to 16 rows (one row block against whole panels), 17-32
    (two blocks against half panels), more (blocks of 32 and a short last one, down to 1 row;
    rows in chunks where K is long),
    N not a multiple of the 16-column tile or the 64-column panel, with and without bias: within
    one bf16 rounding of the f32 result, and the f32-output form gives the bf16 result's values
    exactly. K not a multiple of 32 runs the dot-product kernel instead: its result exactly."""
    from iterserve.model.layers import AmxLinear, PairLinear

    kern = _kern()
    if not kern.has_amx:
        pytest.skip("compiled in only where the CPU has AMX-BF16 tiles")
    torch.manual_seed(0)
    for K in (32, 96, 48):
        for M in (1, 2, 7, 16, 17, 20, 32, 33, 47, 64, 100):
            for N in (8, 37, 64, 100, 130):
                x = torch.randn(M, K).bfloat16()
                w = torch.randn(N, K).bfloat16()
                b = torch.randn(N).bfloat16()
                for bias in (None, b):
                    lin = AmxLinear(kern, w, bias)
                    y = lin(x)
                    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
                    ref = F.linear(x.float(), w.float(), None if bias is None else b.float())
                    tol = ref.abs() * 2**-8 + 1e-3
                    assert ((y.float() - ref).abs() <= tol).all(), (K, M, N)
                    assert torch.equal(lin.f32(x), y.float()), (K, M, N)
                    if K % 32:
                        assert torch.equal(y, PairLinear(kern, w, bias, lin.pairs)(x))
    # K = 8192: x is taken in chunks of 64 rows (its rows that fit ~1 MB), 100 rows in two
    x, w = torch.randn(100, 8192).bfloat16(), torch.randn(40, 8192).bfloat16()
    ref = F.linear(x.float(), w.float())
    assert ((AmxLinear(kern, w, None)(x).float() - ref).abs() <= ref.abs() * 2**-8 + 1e-2).all()
    with pytest.raises(ValueError, match="K even"):
        kern.gemm_pairs(torch.zeros(2, 41).bfloat16(), kern.pack_pairs(w), N, amx=True)


def test_gemm_argmax_is_the_argmax_of_its_f32_result() -> None:
    """``gemm_argmax`` (the LM head's greedy tokens without its logits), on the dot-product pair
    GEMM and on AMX tiles where the CPU has them: the argmax of what the same GEMM's f32 output
    holds, row by row, over every row tile (6, 4, 2, 1; AMX: whole and half panels), several
    panels per thread, N not a multiple of 16, K not one of 32 (dot products), with and without
    bias; the first of equal maxima (duplicated weight rows, also across the threads' column
    ranges), a NaN above any number (the first NaN), and every value -inf giving column 0, as
    ``kern.argmax`` and torch's argmax; ``linear_argmax`` gives the same. On AMX, K not a
    multiple of 32: None (the caller takes the two calls)."""
    from iterserve.model.layers import AmxLinear, PairLinear, linear_argmax

    kern = _kern()
    if not kern.has_bf16_dot:
        pytest.skip("compiled in only where the CPU has AVX512-BF16")
    torch.manual_seed(0)
    for amx in (False, True) if kern.has_amx else (False,):
        for M in (1, 5, 7, 16, 17, 32, 40, 130):
            for N, K in ((37, 64), (64, 48), (1000, 64), (4100, 32)):
                if amx and K % 32:
                    continue
                x = torch.randn(M, K).bfloat16()
                w = torch.randn(N, K).bfloat16()
                w[N - 3] = w[5]  # a tie between the first and (for 2 threads) the last column range
                w[N // 2 + 1] = w[5]
                x[0] = w[5]  # row 0's maximum is the duplicated column, most likely
                b = torch.randn(N).bfloat16()
                for bias in (None, b):
                    P = kern.pack_pairs(w)
                    logits = kern.gemm_pairs(x, P, N, bias, out_f32=True, amx=amx)
                    got = kern.gemm_argmax(x, P, N, bias, amx=amx)
                    assert got is not None and torch.equal(got, kern.argmax(logits)), (amx, M, N)
                    assert torch.equal(got, logits.argmax(-1)), (amx, M, N)
                    lin = (AmxLinear if amx else PairLinear)(kern, w, bias, P)
                    assert torch.equal(linear_argmax(lin, x, kern), got)
        # an odd K: the layer pads x with a zero column, as its GEMM does
        w, x = torch.randn(300, 47).bfloat16(), torch.randn(9, 47).bfloat16()
        lin = (AmxLinear if amx else PairLinear)(kern, w, None)
        want = lin.f32(x).argmax(-1)
        assert torch.equal(linear_argmax(lin, x, kern), want), amx
        # inf weights: +inf, -inf and NaN (inf - inf) columns
        w = torch.randn(300, 64).bfloat16()
        w[[40, 200], 0] = float("inf")
        w[[100, 250], 0] = float("-inf")
        x = torch.randn(4, 64).bfloat16()
        x[:, 0] = torch.tensor([1.0, -1.0, 0.0, 2.0])  # 0 * inf: NaN columns in row 2
        P = kern.pack_pairs(w)
        logits = kern.gemm_pairs(x, P, 300, None, out_f32=True, amx=amx)
        assert torch.isnan(logits[2]).any() and torch.isinf(logits[0]).any()
        got = kern.gemm_argmax(x, P, 300, amx=amx)
        assert got is not None and torch.equal(got, kern.argmax(logits)), (got, logits)
        assert torch.equal(got, logits.argmax(-1))
        # every logit -inf: column 0
        w = torch.zeros(50, 32).bfloat16()
        w[:, 0] = float("-inf")
        got = kern.gemm_argmax(torch.ones(3, 32).bfloat16(), kern.pack_pairs(w), 50, amx=amx)
        assert got is not None and got.tolist() == [0, 0, 0]
        # one thread, and more threads than cores (some with fewer panels than others)
        threads = torch.get_num_threads()
        try:
            for nt in (1, 3):
                torch.set_num_threads(nt)
                x = torch.randint(-2, 3, (40, 64)).bfloat16()  # small integers: many ties
                w = torch.randint(-2, 3, (1000, 64)).bfloat16()
                P = kern.pack_pairs(w)
                logits = kern.gemm_pairs(x, P, 1000, None, out_f32=True, amx=amx)
                got = kern.gemm_argmax(x, P, 1000, amx=amx)
                assert got is not None and torch.equal(got, logits.argmax(-1)), (amx, nt)
        finally:
            torch.set_num_threads(threads)
    if kern.has_amx:
        w48 = kern.pack_pairs(torch.randn(9, 48).bfloat16())
        assert kern.gemm_argmax(torch.randn(2, 48).bfloat16(), w48, 9, amx=True) is None


def test_gemm_screen_argmax_gives_gemm_argmax_tokens() -> None:
    """The LM head's greedy argmax screened on an int8 copy (``gemm_screen_argmax``): the tokens
    ``gemm_argmax`` gives, at 1 to 4 rows, over N not a multiple of 64, an odd K (x padded),
    rows pointing along a weight row (near ties), duplicated weight rows (exact ties: the
    first column, also across the threads' panel ranges), 1 to 3 threads, and through
    ``linear_argmax`` with the screen attached; None (take gemm_argmax) with more rows, x all
    zero or not finite; no screen for weights with a NaN or an infinity, or a biased head."""
    from iterserve.model.kernels import LM_SCREEN_MAX_ROWS
    from iterserve.model.layers import PairLinear, attach_lm_screen, linear_argmax

    kern = _kern()
    if not kern.has_lm_screen:
        pytest.skip("compiled in only where the CPU has AVX512-BF16 and VNNI")
    g = torch.Generator().manual_seed(0)
    checked = 0
    for nt in _each_thread_count((1, 2, 3)):
        for N, K in ((70, 7), (1000, 64), (4100, 96), (3000, 576)):
            w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
            w[N - 3] = w[5]  # exact ties, across the threads' panel ranges
            w[N // 2 + 1] = w[5]
            P = kern.pack_pairs(w)
            screen = kern.pack_lm_screen(w)
            assert screen is not None
            Kp = 2 * -(-K // 2)
            for M in range(1, LM_SCREEN_MAX_ROWS + 1):
                for trial in range(6):
                    if trial % 3 == 0:
                        x = torch.randn(M, K, generator=g)
                    else:  # along weight rows (the tied one in trial 2): near or exact ties
                        rows = torch.randint(0, N, (M,), generator=g) if trial == 1 else 5
                        x = w[rows].float().reshape(-1, K).expand(M, K) * 10
                    xp = F.pad(x.bfloat16(), (0, Kp - K))
                    want = kern.gemm_argmax(xp, P, N)
                    got = kern.gemm_screen_argmax(xp, P, screen)
                    assert got is not None and torch.equal(got, want), (nt, N, K, M, trial)
                    checked += 1
    assert checked == 3 * 4 * LM_SCREEN_MAX_ROWS * 6
    # the bound itself: one large element a row makes the int8 step coarse for the others
    # (the copy's argmax is another column in about one row of five), so only the bound keeps
    # the right column among the candidates
    for trial in range(10):
        w = torch.randn(2000, 128, generator=g)
        w[:, 0] = 60
        x = torch.randn(LM_SCREEN_MAX_ROWS, 128, generator=g)
        x[:, 0] = 0
        P, screen = kern.pack_pairs(w.bfloat16()), kern.pack_lm_screen(w.bfloat16())
        assert screen is not None
        for M in range(1, LM_SCREEN_MAX_ROWS + 1):
            xb = x[:M].bfloat16()
            got = kern.gemm_screen_argmax(xb, P, screen)
            assert got is not None and torch.equal(got, kern.gemm_argmax(xb, P, 2000)), trial
    # the argmax compares bf16-rounded logits: column 3's 127.98 rounds to column 330's 128,
    # and the first of the equal values wins, though its own logit is lower by more than the
    # int8 copy's bound
    w = torch.randn(2000, 128, generator=g) * 0.1
    signs = torch.randint(0, 2, (128,), generator=g).float() * 2 - 1
    w[330] = signs
    w[3] = signs
    w[3, 7] *= 0.984375  # bf16-exact, 1 / 64 lower: logit 128 - 1 / 64
    P, screen = kern.pack_pairs(w.bfloat16()), kern.pack_lm_screen(w.bfloat16())
    assert screen is not None
    x = signs[None].bfloat16()
    assert kern.gemm_argmax(x, P, 2000).tolist() == [3]
    assert kern.gemm_screen_argmax(x, P, screen).tolist() == [3]  # type: ignore[union-attr]
    # all logits negative, around one value (the margin below a negative L), and x scaled far
    # from 1 either way
    for scale in (2.0**-40, 2.0**-8, 1.0, 2.0**30):
        w = -(torch.ones(2000, 128) + torch.randn(2000, 128, generator=g) * 0.01)
        x = torch.ones(2, 128) * scale
        P, screen = kern.pack_pairs(w.bfloat16()), kern.pack_lm_screen(w.bfloat16())
        assert screen is not None
        got = kern.gemm_screen_argmax(x.bfloat16(), P, screen)
        assert got is not None and torch.equal(got, kern.gemm_argmax(x.bfloat16(), P, 2000))
    # outside the range the bound covers: vdpbf16ps reads denormals as zero, so the screen
    # does too; where |x| max|w| could overflow, it declines
    cases = [  # (x, column 0, column 64, screened: the same token, else None)
        ([2.0**100, 1.0], [0, 2.0**-111], [2.0**-130, 0], True),  # a denormal weight
        ([2.0**-127, 2.0**-126], [0, 2.0**90], [2.0**100, 0], True),  # a denormal x
        ([2.0**120, 2.0**-10], [2.0**-110, 0], [0, 2.0**31], False),  # s t would overflow
        ([2.0**64, 0, 2.0**64, 0], [2.0**56, 0, 0, 0], [2.0**64, 0, -(2.0**64), 0], False),
    ]
    for xs, c0, c64, screened in cases:
        w = torch.zeros(128, len(xs))
        w[0], w[64] = torch.tensor(c0), torch.tensor(c64)
        x = torch.tensor([xs]).bfloat16()
        P, screen = kern.pack_pairs(w.bfloat16()), kern.pack_lm_screen(w.bfloat16())
        assert screen is not None
        got = kern.gemm_screen_argmax(x, P, screen)
        if screened:
            assert got is not None and torch.equal(got, kern.gemm_argmax(x, P, 128)), xs
        else:
            assert got is None, xs
    # and it screens: at bench-134m's LM head shape a random row runs a few of the 500 panels
    w = (torch.randn(32000, 768, generator=g) * 0.05).bfloat16()
    P, screen = kern.pack_pairs(w), kern.pack_lm_screen(w)
    assert screen is not None
    ran: list[int] = []
    for _ in range(10):
        x = torch.randn(1, 768, generator=g).bfloat16()
        got = kern.gemm_screen_argmax(x, P, screen, ran)
        assert got is not None and torch.equal(got, kern.gemm_argmax(x, P, 32000))
    assert len(ran) == 10 and max(ran) <= 40 and sorted(ran)[5] <= 12, ran
    w = torch.randn(300, 64).bfloat16()
    P, screen = kern.pack_pairs(w), kern.pack_lm_screen(w)
    assert screen is not None
    assert (
        kern.gemm_screen_argmax(torch.randn(LM_SCREEN_MAX_ROWS + 1, 64).bfloat16(), P, screen)
        is None
    )
    assert kern.gemm_screen_argmax(torch.zeros(1, 64).bfloat16(), P, screen) is None
    x = torch.randn(2, 64).bfloat16()
    x[1, 3] = float("nan")
    assert kern.gemm_screen_argmax(x, P, screen) is None
    with pytest.raises(ValueError, match="columns"):
        kern.gemm_screen_argmax(torch.randn(1, 32).bfloat16(), kern.pack_pairs(w[:, :32]), screen)
    bad = w.clone()
    bad[7, 9] = float("inf")
    assert kern.pack_lm_screen(bad) is None
    # linear_argmax takes the screen where it is attached: the same tokens, with it called
    lin = PairLinear(kern, w, None)
    assert attach_lm_screen(lin, w) == [1, 2, 3, 4] and lin.screen is not None
    calls = []
    screen_fn = kern.gemm_screen_argmax
    kern.gemm_screen_argmax = lambda *a: calls.append(1) or screen_fn(*a)  # type: ignore[method-assign]
    try:
        for M in (1, 3, 6):
            x = torch.randn(M, 64).bfloat16()
            assert torch.equal(linear_argmax(lin, x, kern), lin.f32(x).argmax(-1))
    finally:
        del kern.gemm_screen_argmax
    assert len(calls) == 2  # 1 and 3 rows; 6 take gemm_argmax
    assert attach_lm_screen(PairLinear(kern, w, torch.randn(300).bfloat16()), w) == []


def test_gemm_swiglu_gives_the_bits_of_the_gemm_then_silu_mul() -> None:
    """``gemm_swiglu`` (gate_up and SwiGLU in one call, the product never stored) on a weight
    in GLU_BLOCK's layout, on the dot-product pair GEMM and on AMX tiles where the CPU has
    them: exactly ``silu_mul(gemm_pairs(x), GLU_BLOCK)`` on the same GEMM, which is ``silu_mul``
    of the [gate; up] weight's product, over every row tile (6, 4, 2, 1; AMX: whole and half
    panels), several panels or units per thread, intermediate sizes of an odd count of
    32-column units (96, 160), with and without bias; and ``GateUpAct`` gives
    ``act(gate_up(x))`` at every row count, fused or not. intermediate not a multiple of 32
    (on AMX also K): None."""
    from iterserve.model.layers import (
        GLU_BLOCK,
        AmxLinear,
        FusedSiluMul,
        GateUpAct,
        PairLinear,
        gate_up_layout,
    )

    kern = _kern()
    if not kern.has_bf16_dot:
        pytest.skip("compiled in only where the CPU has AVX512-BF16")
    torch.manual_seed(0)
    for amx in (False, True) if kern.has_amx else (False,):
        for M in (1, 5, 7, 16, 17, 32, 33, 100):
            for inter, K in ((64, 64), (96, 128), (160, 32), (512, 96), (64, 48)):
                if amx and K % 32:
                    continue
                w = torch.randn(2 * inter, K).bfloat16()
                x = torch.randn(M, K).bfloat16()
                for b in (None, torch.randn(2 * inter).bfloat16()):
                    want = kern.silu_mul(
                        kern.gemm_pairs(x, kern.pack_pairs(w), 2 * inter, b, amx=amx)
                    )
                    act = FusedSiluMul(kern, GLU_BLOCK)
                    wi, bi = gate_up_layout(act, w, b)
                    P = kern.pack_pairs(wi)
                    assert torch.equal(
                        kern.silu_mul(kern.gemm_pairs(x, P, 2 * inter, bi, amx=amx), GLU_BLOCK),
                        want,
                    )
                    got = kern.gemm_swiglu(x, P, inter, bi, amx=amx)
                    assert got is not None and torch.equal(got, want), (amx, M, inter, K)
                    lin = (AmxLinear if amx else PairLinear)(kern, wi, bi, P)
                    assert torch.equal(GateUpAct(lin, act)(x), want)
        w = torch.randn(2 * 48, 64).bfloat16()
        assert (
            kern.gemm_swiglu(torch.randn(20, 64).bfloat16(), kern.pack_pairs(w), 48, amx=amx)
            is None
        )
    if kern.has_amx:
        w = torch.randn(64, 48).bfloat16()
        assert (
            kern.gemm_swiglu(torch.randn(20, 48).bfloat16(), kern.pack_pairs(w), 32, amx=True)
            is None
        )


def test_the_act_takes_gate_up_in_blocks_only_with_the_pair_gemm_and_a_multiple_of_32() -> None:
    """``choose_act``: the fused SwiGLU on gate_up in GLU_BLOCK's layout only where the pair
    GEMM runs (AVX512-BF16, with or without AMX tiles) and the intermediate size is a multiple
    of 32 (what its SwiGLU epilogue needs); elsewhere [gate | up]; torch's SiluMul without the
    kernels."""
    from iterserve.model.layers import GLU_BLOCK, SiluMul, choose_act

    kern = _kern()
    assert type(choose_act(None, 64)) is SiluMul and choose_act(None, 64).block == 0
    assert choose_act(kern, 64).block == (GLU_BLOCK if kern.has_bf16_dot else 0)
    assert choose_act(kern, 48).block == 0
    avx2 = avx2_kernels()  # built without AVX-512, so without the pair GEMM
    assert not avx2.has_bf16_dot and choose_act(avx2, 64).block == 0


def test_amx_epilogue_deferred_or_not_gives_the_same_bits() -> None:
    """From 17 rows to 1,024 the AMX GEMM runs a unit's epilogue during the next unit's products
    (cpu_kernels.cpp, DEFER_MAX_ROWS); past that, at once. The first 1,024 rows of a 1,025-row
    call (at once) equal a 1,024-row call (deferred), for the bf16 and f32 results, SwiGLU and
    the argmax, with several units per thread and a last unit narrower than 32 columns."""
    kern = _kern()
    if not kern.has_amx:
        pytest.skip("compiled in only where the CPU has AMX-BF16 tiles")
    torch.manual_seed(0)
    x = torch.randn(1025, 64).bfloat16()
    w, b = torch.randn(200, 64).bfloat16(), torch.randn(200).bfloat16()
    P = kern.pack_pairs(w)
    for out_f32 in (False, True):
        big = kern.gemm_pairs(x, P, 200, b, out_f32=out_f32, amx=True)
        small = kern.gemm_pairs(x[:1024], P, 200, b, out_f32=out_f32, amx=True)
        assert torch.equal(big[:1024], small)
    big_a = kern.gemm_argmax(x, P, 200, b, amx=True)
    small_a = kern.gemm_argmax(x[:1024], P, 200, b, amx=True)
    assert big_a is not None and small_a is not None and torch.equal(big_a[:1024], small_a)
    gu = kern.pack_pairs(torch.randn(2 * 96, 64).bfloat16())
    big_s = kern.gemm_swiglu(x, gu, 96, amx=True)
    small_s = kern.gemm_swiglu(x[:1024], gu, 96, amx=True)
    assert big_s is not None and small_s is not None and torch.equal(big_s[:1024], small_s)


def test_logits_in_f32_whatever_the_lm_head_path() -> None:
    """``linear_f32`` (the LM head's logits) gives ``lin(x).float()`` on every path: a pair
    GEMM writes f32 directly, also when a row router picks it, and any other path is converted."""
    from iterserve.model.autotune import ByRows
    from iterserve.model.layers import PairLinear, TorchLinear, linear_f32

    kern = _kern()
    if not kern.has_bf16_dot:
        pytest.skip("compiled in only where the CPU has AVX512-BF16")
    torch.manual_seed(0)
    w = torch.randn(100, 32).bfloat16()
    pair, plain = PairLinear(kern, w, None), TorchLinear(w, None)
    routed = ByRows([2, 1 << 30], [plain, pair])
    for lin in (pair, plain, routed):
        for rows in (1, 2, 3, 9):
            x = torch.randn(rows, 32).bfloat16()
            y = linear_f32(lin, x)
            assert y.dtype == torch.float32 and torch.equal(y, lin(x).float()), (lin, rows)


def test_gemm_pairs12_gives_gemm_pairs_bits() -> None:
    """The pair GEMM on 12-bit weights (``pack_pairs12`` / ``gemm_pairs12``): gemm_pairs' bits
    (bf16 and f32 out, and gemm_swiglu's) at 1 to 4 rows, 1 to 3 threads, N not a multiple of
    64, with bias or none, for weights holding values outside the window (zeros, denormals,
    large outliers, NaN, infinities: the exceptions, patched back bit for bit); None with more
    rows. No 12-bit form for an odd K or a weight that mostly lies outside any 8-value
    window."""
    from iterserve.model.kernels import PAIRS12_MAX_ROWS

    kern = _kern()
    if not kern.has_pairs12:
        pytest.skip("compiled in only where the CPU has AVX512-BF16 and AVX512-BW")
    g = torch.Generator().manual_seed(0)
    checked = 0
    for nt in _each_thread_count((1, 2, 3)):
        for N, K in ((70, 64), (256, 64), (1000, 96), (192, 1536)):
            w = (torch.randn(N, K, generator=g) * 0.02).bfloat16()
            flat = w.view(-1)
            for value, step, first in (
                (0.0, 903, 0), (-0.0, 1497, 3), (1e-39, 2103, 5), (40.0, 633, 7),
                (float("nan"), 2991, 11), (float("-inf"), 4497, 13), (-3e-8, 1167, 17),
            ):  # fmt: skip
                flat[first::step] = value
            p12 = kern.pack_pairs12(w)
            assert p12 is not None and p12.exc_start[-1] > 0
            high = (w.view(torch.int16) >> 8).int() & 127
            outside = ((high < p12.base) | (high >= p12.base + 8)).sum()
            assert int(p12.exc_start[-1]) == int(outside)
            P = kern.pack_pairs(w)
            for M in range(1, PAIRS12_MAX_ROWS + 2):
                x = torch.randn(M, K, generator=g).bfloat16()
                for b in (None, torch.randn(N, generator=g).bfloat16()):
                    got = kern.gemm_pairs12(x, p12, b)
                    if M > PAIRS12_MAX_ROWS:
                        assert got is None
                        assert kern.gemm_pairs12(x, p12, b, out_f32=True) is None
                        continue
                    want = kern.gemm_pairs(x, P, N, b)
                    assert got is not None
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                        nt, N, K, M,
                    )  # fmt: skip
                    got32 = kern.gemm_pairs12(x, p12, b, out_f32=True)
                    want32 = kern.gemm_pairs(x, P, N, b, out_f32=True)
                    assert got32 is not None and got32.dtype == torch.float32
                    assert torch.equal(got32.view(torch.int32), want32.view(torch.int32))
                    if N % 64 == 0:
                        act = kern.gemm_swiglu12(x, p12, b)
                        want_act = kern.gemm_swiglu(x, P, N // 2, b)
                        assert act is not None and want_act is not None
                        assert torch.equal(act.view(torch.int16), want_act.view(torch.int16))
                    checked += 1
    assert checked == 3 * 4 * PAIRS12_MAX_ROWS * 2
    # windows at either end (zeros, denormals, infinities and NaN as codes, not exceptions), and
    # exceptions in the last k pair of the last, padded panel
    for scale, base, specials in (
        (2.0**-118, 0, (0.0, -0.0, 1e-39, -3e-39)),
        (2.0**126, 120, (float("inf"), float("-inf"), float("nan"))),
        (0.02, None, ()),
    ):
        w = torch.randn(100, 96, generator=g)
        if base == 120:  # all in [2^126, 2^127) but the specials: 120 the only window for both
            w = w.sign() * (1 + torch.rand(100, 96, generator=g) * 0.99)
        w = (w * scale).bfloat16()
        for i, v in enumerate(specials):
            w[7 * i + 3, 5 * i + 1] = v
        if base is None:
            w[99, 94:] = torch.tensor([300.0, -1e-30])  # outside the window: exceptions
        p12 = kern.pack_pairs12(w)
        assert p12 is not None and (base is None or p12.base == base), p12
        assert (int(p12.exc_start[-1]) == 2) == (base is None)
        P = kern.pack_pairs(w)
        for M in range(1, PAIRS12_MAX_ROWS + 1):
            x = torch.randn(M, 96, generator=g).bfloat16()
            got, want = kern.gemm_pairs12(x, p12), kern.gemm_pairs(x, P, 100)
            assert got is not None and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert kern.pack_pairs12(torch.randn(64, 7).bfloat16()) is None  # odd K
    wide = torch.randn(128, 64, generator=g) * 2.0 ** torch.randint(-30, 30, (128, 64), generator=g)
    assert kern.pack_pairs12(wide.bfloat16()) is None  # exponents far wider than the window
    with pytest.raises(ValueError, match="pack_pairs12 takes a 2-D bf16 weight"):
        kern.pack_pairs12(torch.randn(64, 8))
    p12 = kern.pack_pairs12(torch.randn(64, 8).bfloat16())
    assert p12 is not None
    with pytest.raises(ValueError, match=r"gemm_pairs12 takes bf16 x \[M, 8\]"):
        kern.gemm_pairs12(torch.randn(1, 6).bfloat16(), p12)
