// CPU kernels for the two places where torch's own kernels leave most of this machine's memory
// bandwidth unused (see docs/SPEED.md). Plain C ABI, called through ctypes by
// iterserve/model/kernels.py, which compiles this file with the system C++ compiler on first
// use (-O3 -march=native -fopenmp) and caches the library. Threads: OpenMP; torch's CPU build
// ships libgomp.so.1 and loads it first, so these loops share torch's thread pool and its
// torch.set_num_threads() setting.
//
// 1. gemm_panels: y[M, N] = x[M, K] . W[N, K]^T (+ bias) with a bf16 weight laid out once in
//    panels (pack_bf16_panels). On a CPU without AVX512-BF16, torch runs bf16 GEMMs through an
//    emulation (a GEMV streams the weight at ~14 GB/s, 8 rows reach ~20 GFLOP/s); here the
//    weight is widened to f32 in registers (a bf16 is the top half of an f32), crosses the
//    memory bus once per call in its 2-byte form, and feeds a register-tiled f32 FMA kernel.
// 2. paged_decode_attention: one query token per sequence against its own context in the paged
//    KV cache (bf16 or f32), with no padding to the longest context and no gathered copy.
// 3. paged_prefill_attention: causal attention of a bf16 prefill chunk over the paged cache, in
//    place (no gathered K / V, no [n, ctx] mask): bf16 dot products with AVX512-BF16 (on AMX
//    tiles where the kernel may use them), f32 FMA on AVX2 without AVX-512.
//
// Accumulation is f32 throughout; results are rounded to bf16 (nearest even) only on output.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <queue>
#include <type_traits>
#include <utility>
#include <vector>

// AVX2 + FMA without AVX-512 (e.g. AMD Zen 2/3, Intel Haswell..Alder Lake): 8-lane versions
// of the GEMM, attention and row-wise (RMSNorm, SwiGLU, RoPE, argmax) loops.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ITERSERVE_AVX2 1
#endif
#if defined(__AVX512F__) || defined(ITERSERVE_AVX2)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif
// AMX tiles (Intel Sapphire Rapids and later): gemm_amx runs the pair-packed weights on them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define ITERSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// Row-wise elementwise kernels (RMSNorm, SwiGLU, RoPE, argmax) run on one thread below this
// many elements, where waking the second thread costs about what it saves (docs/SPEED.md,
// "Elementwise kernels on two threads from 32K elements").
constexpr int64_t PAR_MIN_ELEMS = int64_t(1) << 15;
constexpr int GP_COLS = 64;  // output columns per pair panel (gemm_pairs)

// --- Pair panels in 12 bits a weight (gemm_pairs12) -----------------------------------------
// A bf16 weight's high byte is its sign and the top 7 bits of its exponent; a layer's weights
// mostly use 8 consecutive values of those 7 bits (bench-134m: all but ~7 in 10^5). So a k pair
// of a pair panel (128 bf16, gemm_pairs' order) is stored as its 128 low bytes as they are and
// 128 4-bit codes, sign << 3 | (high 7 bits - base): 192 bytes, not 256. The weights outside the
// window (zeros, denormals, outliers, NaN) are exceptions, patched in with their exact bits; so
// the tile multiplies exactly gemm_pairs' bf16 values in its order: the same output bits. At a
// few rows a decode step's GEMMs are bound by the bytes they read (docs/SPEED.md, "Zen 4, a
// twenty-first session").
constexpr int P12_BLOCK = 192;     // bytes a k pair: low bytes [128], then the codes [64]
constexpr int PAIRS12_MAX_ROWS = 4;  // gemm_pairs12 runs 1 to this many rows
struct Pairs12 {
    const uint8_t* blocks;     // panels of K / 2 blocks
    const uint32_t* exc_off;   // exceptions in order: (panel * K / 2 + k pair) * 128 + word
    const uint16_t* exc_val;   // their bf16 bits
    const int32_t* exc_start;  // [panels + 1]: each panel's first exception
    int32_t base;              // the window's first high-7-bit value
};

// The calling OpenMP thread's contiguous share [begin, end) of n items (all of them outside a
// parallel region).
inline std::pair<int, int> thread_share(int n) {
    int tid = 0, nth = 1;
#if defined(_OPENMP)
    tid = omp_get_thread_num();
    nth = omp_get_num_threads();
#endif
    return {static_cast<int>(static_cast<int64_t>(n) * tid / nth), static_cast<int>(static_cast<int64_t>(n) * (tid + 1) / nth)};
}

// Scratch for one call of n elements, never zeroed (the caller writes every element): the
// calling thread's buffer, kept across calls up to 64 MB (a step calls the prefill kernels once
// per layer and chunk: no page faults, no zero fill), a fresh one above that.
template <typename T>
struct Scratch {
    std::unique_ptr<T[]> once;  // not a vector: no zero fill
    T* data;
    explicit Scratch(size_t n) {
        thread_local std::vector<T> kept;
        if (n <= (size_t(64) << 20) / sizeof(T)) {
            if (kept.size() < n) kept.resize(n);
            data = kept.data();
        } else {
            once.reset(new T[n]);
            data = once.get();
        }
    }
};

inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// Row r of a matrix stored as bf16 (is_f32 == 0) or f32 (is_f32 == 1), widened into dst[0:n].
inline void load_row(const void* base, int is_f32, int64_t offset, int n, float* dst) {
    if (is_f32) {
        std::memcpy(dst, static_cast<const float*>(base) + offset, sizeof(float) * n);
    } else {
        const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
        for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
    }
}

inline void store_row(void* base, int is_f32, int64_t offset, int n, const float* src) {
    if (is_f32) {
        std::memcpy(static_cast<float*>(base) + offset, src, sizeof(float) * n);
    } else {
        uint16_t* dst = static_cast<uint16_t*>(base) + offset;
        for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
    }
}


#if defined(ITERSERVE_AVX2)
inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 s = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
        return _mm512_reduce_add_ps(s);
    }
#elif defined(ITERSERVE_AVX2)
    if (n % 16 == 0) {  // two chains: one would wait on the FMA latency
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        return hsum8(_mm256_add_ps(s0, s1));
    }
#endif
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline void axpy(float w, const float* x, float* y, int n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        const __m512 wv = _mm512_set1_ps(w);
        for (int i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
        return;
    }
#elif defined(ITERSERVE_AVX2)
    if (n % 8 == 0) {
        const __m256 wv = _mm256_set1_ps(w);
        for (int i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#endif
    for (int i = 0; i < n; ++i) y[i] += w * x[i];
}

#if defined(__AVX512F__)
// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, times 2^n
// with vscalefps (which also takes -inf to 0). Relative error ~2e-7.
inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
// 2^x for 16 lanes: x = n + r, |r| <= 1/2, 2^r by a degree-5 minimax polynomial (relative error
// ~2.4e-7), times 2^n with vscalefps; x below -160 (-inf included) gives 0.
inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-160.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.0013276470126584172f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.009675541892647743f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05550713464617729f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022120237350464f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931469440460205f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
inline __m512 widen16(const uint16_t* p) {  // 16 bf16 -> f32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512i bf16_bits(__m512 v) {  // round to nearest even, in the top 16 bits (finite values)
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
inline __m512 round_bf16(__m512 v) {  // f32 -> nearest bf16, as f32
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void narrow16(uint16_t* p, __m512 v) {  // f32 -> 16 bf16 (nearest even)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
// bf16(silu(g)) * u for 16 bf16-valued g and u (f32): SwiGLU's arithmetic, before the output's
// rounding; silu_mul_bf16 and the GEMMs' SwiGLU epilogue (glu_store) both take it.
inline __m512 swiglu16(__m512 g, __m512 u) {
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(round_bf16(s), u);
}
#endif

#if defined(ITERSERVE_AVX2)
// exp(x) for 8 lanes, as exp_ps: x = n ln2 + r, exp(r) by the same degree-6 polynomial, times
// 2^n built in the exponent field; x below -87 (where 2^n would leave the normal range; -inf
// included) gives 0.
inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

#if defined(ITERSERVE_AVX2)
// The 8-lane versions of widen16 / round_bf16 / narrow16.
inline __m256 widen8(const uint16_t* p) {  // 8 bf16 -> f32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i bf16_bits8(__m256 v) {  // round to nearest even, in the top 16 bits (finite values)
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
inline __m256 round_bf16_8(__m256 v) {  // f32 -> nearest bf16, as f32
    return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits8(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void narrow8(uint16_t* p, __m256 v) {  // f32 -> 8 bf16 (nearest even)
    const __m256i u = _mm256_srli_epi32(bf16_bits8(v), 16);
    // packus works within 128-bit lanes: [0-3, 0-3 | 4-7, 4-7] -> qwords 0 and 2 hold 0-7
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// x[0:n] = softmax(x[0:n]); x[n:ld] hold -inf (padding to a multiple of 16). Returns
// log(sum(exp(x))) of the input, which merges softmaxes taken over parts of one row.
inline float softmax_inplace(float* x, int64_t n, int64_t ld) {
#if defined(__AVX512F__)
    if (ld % 16 == 0) {
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < ld; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < ld; i += 16) {
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx));
            _mm512_storeu_ps(x + i, e);
            s = _mm512_add_ps(s, e);
        }
        const float sum = _mm512_reduce_add_ps(s);
        const __m512 inv = _mm512_set1_ps(1.f / sum);
        for (int64_t i = 0; i < ld; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        return _mm512_cvtss_f32(mx) + std::log(sum);
    }
#elif defined(ITERSERVE_AVX2)
    if (ld % 8 == 0) {
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (int64_t i = 0; i < ld; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
        const __m256 mx = _mm256_set1_ps(hmax8(m));
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < ld; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx));
            _mm256_storeu_ps(x + i, e);
            s = _mm256_add_ps(s, e);
        }
        const float sum = hsum8(s);
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        for (int64_t i = 0; i < ld; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
        return _mm256_cvtss_f32(mx) + std::log(sum);
    }
#endif
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::fmax(mx, x[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - mx);
        sum += x[i];
    }
    for (int64_t i = 0; i < n; ++i) x[i] /= sum;
    return mx + std::log(sum);
}


// ---- GEMM over bf16 weight panels --------------------------------------------------------
// A panel holds 32 output columns (weight rows) for every k: 32 bf16 = one 64-byte line per k,
// laid out so that 32-bit lane i holds column i in its low half and column i + 16 in its high
// half. One load and two single-uop ops (shift, and) widen a line into two f32 vectors; every x
// value is broadcast into FMAs against both. No horizontal sums; accumulators are per column.
constexpr int PANEL = 32;
// Lines ahead to prefetch: the hardware prefetcher alone leaves the FMAs waiting on memory
// (all bench-134m GEMMs at 8 rows: 16.3 ms without, 10-11.5 ms with; 32 to 128 lines all do).
constexpr int PREFETCH = 64;

#if defined(__AVX512F__)
inline void store16(void* y, int y_f32, int64_t offset, __m512 v, int valid) {
    if (valid >= 16) {
        if (y_f32) {
            _mm512_storeu_ps(static_cast<float*>(y) + offset, v);
        } else {
            __m512i u = _mm512_castps_si512(v);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + offset), _mm512_cvtepi32_epi16(u));
        }
        return;
    }
    if (valid <= 0) return;
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    store_row(y, y_f32, offset, valid, tmp);
}

// Rows [m0, m0 + MB) of x against one panel; KU independent accumulator sets over k (for rows
// few enough that one set would leave the FMA units waiting on their latency).
template <int MB, int KU>
void panel_rows(const uint16_t* P, const float* xf, const float* bias, void* y, int y_f32, int N, int K, int n0, int m0) {
    __m512 acc[KU][MB][2];
    for (int u = 0; u < KU; ++u)
        for (int i = 0; i < MB; ++i) acc[u][i][0] = acc[u][i][1] = _mm512_setzero_ps();
    const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const float* x0 = xf + static_cast<int64_t>(m0) * K;
    int k = 0;
    for (; k + KU <= K; k += KU) {
        for (int u = 0; u < KU; ++u) {
            __builtin_prefetch(P + static_cast<int64_t>(k + u + PREFETCH) * PANEL, 0, 3);
            const __m512i v = _mm512_loadu_si512(P + static_cast<int64_t>(k + u) * PANEL);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
            for (int i = 0; i < MB; ++i) {
                const __m512 xb = _mm512_set1_ps(x0[static_cast<int64_t>(i) * K + k + u]);
                acc[u][i][0] = _mm512_fmadd_ps(lo, xb, acc[u][i][0]);
                acc[u][i][1] = _mm512_fmadd_ps(hi, xb, acc[u][i][1]);
            }
        }
    }
    for (; k < K; ++k) {
        const __m512i v = _mm512_loadu_si512(P + static_cast<int64_t>(k) * PANEL);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
        for (int i = 0; i < MB; ++i) {
            const __m512 xb = _mm512_set1_ps(x0[static_cast<int64_t>(i) * K + k]);
            acc[0][i][0] = _mm512_fmadd_ps(lo, xb, acc[0][i][0]);
            acc[0][i][1] = _mm512_fmadd_ps(hi, xb, acc[0][i][1]);
        }
    }
    for (int u = 1; u < KU; ++u)
        for (int i = 0; i < MB; ++i) {
            acc[0][i][0] = _mm512_add_ps(acc[0][i][0], acc[u][i][0]);
            acc[0][i][1] = _mm512_add_ps(acc[0][i][1], acc[u][i][1]);
        }
    const int valid = N - n0;
    for (int i = 0; i < MB; ++i) {
        __m512 a = acc[0][i][0], b = acc[0][i][1];
        if (bias) {
            alignas(64) float bb[PANEL] = {0};
            for (int j = 0; j < PANEL && j < valid; ++j) bb[j] = bias[n0 + j];
            a = _mm512_add_ps(a, _mm512_load_ps(bb));
            b = _mm512_add_ps(b, _mm512_load_ps(bb + 16));
        }
        const int64_t off = static_cast<int64_t>(m0 + i) * N + n0;
        store16(y, y_f32, off, a, valid);
        store16(y, y_f32, off + 16, b, valid - 16);
    }
}
#elif defined(ITERSERVE_AVX2)
inline void store8(void* y, int y_f32, int64_t offset, __m256 v, int valid) {
    if (valid >= 8) {
        if (y_f32) {
            _mm256_storeu_ps(static_cast<float*>(y) + offset, v);
        } else {
            __m256i u = _mm256_castps_si256(v);
            const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
            // packus works within 128-bit lanes: [0-3, 0-3 | 4-7, 4-7] -> qwords 0 and 2 hold 0-7
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + offset), _mm256_castsi256_si128(packed));
        }
        return;
    }
    if (valid <= 0) return;
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    store_row(y, y_f32, offset, valid, tmp);
}

// Rows [m0, m0 + MB) of x against one panel, a half panel at a time: a 32-byte half line (lanes
// 0-7 or 8-15 of the AVX-512 layout) widens into columns 8 half + 0..7 and 16 + 8 half + 0..7,
// so MB rows need 2 MB accumulators (16 registers: MB <= 6 with one weight pair and a broadcast).
// The first half streams the panel from memory (prefetched); the second reads it from L2.
template <int MB, int KU>
void panel_rows(const uint16_t* P, const float* xf, const float* bias, void* y, int y_f32, int N, int K, int n0, int m0) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const float* x0 = xf + static_cast<int64_t>(m0) * K;
    const int valid = N - n0;
    for (int half = 0; half < 2; ++half) {
        const uint16_t* Ph = P + 16 * half;
        __m256 acc[KU][MB][2];
        #pragma GCC unroll 16
        for (int u = 0; u < KU; ++u)
            #pragma GCC unroll 16
            for (int i = 0; i < MB; ++i) acc[u][i][0] = acc[u][i][1] = _mm256_setzero_ps();
        int k = 0;
        for (; k + KU <= K; k += KU) {
            #pragma GCC unroll 16
            for (int u = 0; u < KU; ++u) {
                if (half == 0) __builtin_prefetch(P + static_cast<int64_t>(k + u + PREFETCH) * PANEL, 0, 3);
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Ph + static_cast<int64_t>(k + u) * PANEL));
                const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                #pragma GCC unroll 16
                for (int i = 0; i < MB; ++i) {
                    const __m256 xb = _mm256_broadcast_ss(x0 + static_cast<int64_t>(i) * K + k + u);
                    acc[u][i][0] = _mm256_fmadd_ps(lo, xb, acc[u][i][0]);
                    acc[u][i][1] = _mm256_fmadd_ps(hi, xb, acc[u][i][1]);
                }
            }
        }
        for (; k < K; ++k) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Ph + static_cast<int64_t>(k) * PANEL));
            const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
            #pragma GCC unroll 16
            for (int i = 0; i < MB; ++i) {
                const __m256 xb = _mm256_broadcast_ss(x0 + static_cast<int64_t>(i) * K + k);
                acc[0][i][0] = _mm256_fmadd_ps(lo, xb, acc[0][i][0]);
                acc[0][i][1] = _mm256_fmadd_ps(hi, xb, acc[0][i][1]);
            }
        }
        // The sums leave through a plain array: read in the epilogue's loops, the accumulators
        // were kept in memory by GCC 12, stored back on every k (12 stores against 12 FMAs).
        alignas(32) float res[MB][2][8];
        #pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
            __m256 a = acc[0][i][0], b = acc[0][i][1];
            #pragma GCC unroll 16
            for (int u = 1; u < KU; ++u) {
                a = _mm256_add_ps(a, acc[u][i][0]);
                b = _mm256_add_ps(b, acc[u][i][1]);
            }
            _mm256_store_ps(res[i][0], a);
            _mm256_store_ps(res[i][1], b);
        }
        const int c_lo = 8 * half, c_hi = 16 + 8 * half;  // first column of each accumulator
        #pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
            __m256 a = _mm256_load_ps(res[i][0]), b = _mm256_load_ps(res[i][1]);
            if (bias) {
                alignas(32) float ba[8] = {0}, bb[8] = {0};
                for (int j = 0; j < 8; ++j) {
                    if (c_lo + j < valid) ba[j] = bias[n0 + c_lo + j];
                    if (c_hi + j < valid) bb[j] = bias[n0 + c_hi + j];
                }
                a = _mm256_add_ps(a, _mm256_load_ps(ba));
                b = _mm256_add_ps(b, _mm256_load_ps(bb));
            }
            const int64_t off = static_cast<int64_t>(m0 + i) * N + n0;
            store8(y, y_f32, off + c_lo, a, valid - c_lo);
            store8(y, y_f32, off + c_hi, b, valid - c_hi);
        }
    }
}

// Rows [m0, m0 + MB) against one panel, whole lines at a time (MB <= 3: 4 accumulators a row):
// for the few rows of a decode step the panel streams from memory once, where the half-panel
// passes leave memory idle during the second half (1-row GEMMs streamed ~11 GB/s a core).
template <int MB, int KU>
void panel_rows_full(const uint16_t* P, const float* xf, const float* bias, void* y, int y_f32, int N, int K, int n0, int m0) {
    static_assert(MB * KU <= 3 || (MB == 1 && KU == 2), "accumulators must fit in 16 registers");
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const float* x0 = xf + static_cast<int64_t>(m0) * K;
    const int valid = N - n0;
    __m256 acc[KU][MB][4];
#pragma GCC unroll 16
    for (int u = 0; u < KU; ++u)
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) acc[u][i][0] = acc[u][i][1] = acc[u][i][2] = acc[u][i][3] = _mm256_setzero_ps();
    auto line = [&](int k, int u) {
        const uint16_t* Pk = P + static_cast<int64_t>(k) * PANEL;
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; ++hf) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Pk + 16 * hf));
            const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
#pragma GCC unroll 16
            for (int i = 0; i < MB; ++i) {
                const __m256 xb = _mm256_broadcast_ss(x0 + static_cast<int64_t>(i) * K + k);
                acc[u][i][2 * hf] = _mm256_fmadd_ps(lo, xb, acc[u][i][2 * hf]);
                acc[u][i][2 * hf + 1] = _mm256_fmadd_ps(hi, xb, acc[u][i][2 * hf + 1]);
            }
        }
    };
    int k = 0;
    for (; k + KU <= K; k += KU) {
#pragma GCC unroll 16
        for (int u = 0; u < KU; ++u) {
            __builtin_prefetch(P + static_cast<int64_t>(k + u + PREFETCH) * PANEL, 0, 3);
            line(k + u, u);
        }
    }
    for (; k < K; ++k) line(k, 0);
    // acc[.][i][2 hf + e]: columns 16 e + 8 hf + 0..7 (see the half-panel kernel)
    alignas(32) float res[MB][4][8];
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            __m256 a = acc[0][i][j];
#pragma GCC unroll 16
            for (int u = 1; u < KU; ++u) a = _mm256_add_ps(a, acc[u][i][j]);
            _mm256_store_ps(res[i][j], a);
        }
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < 4; ++j) {
            const int c0 = 16 * (j & 1) + 8 * (j >> 1);
            __m256 a = _mm256_load_ps(res[i][j]);
            if (bias) {
                alignas(32) float ba[8] = {0};
                for (int t = 0; t < 8; ++t)
                    if (c0 + t < valid) ba[t] = bias[n0 + c0 + t];
                a = _mm256_add_ps(a, _mm256_load_ps(ba));
            }
            store8(y, y_f32, static_cast<int64_t>(m0 + i) * N + n0 + c0, a, valid - c0);
        }
}

// F32_TILE_MIN_ROWS and more rows: the panel is widened to f32 once per KC lines (into an
// L1-resident buffer) and a plain f32 tile kernel (6 rows x 16 columns: 12 accumulators, two
// weight vectors, a broadcast) runs every row against it, instead of widening each half line
// again in every row tile's pass. Partial sums live in C [M][32] between chunks. Below 32 rows
// the widening's stores cost more than they save (docs/SPEED.md, "f32 tiles").
constexpr int KC = 128;  // lines per widened chunk: 16 KB of f32
constexpr int F32_TILE_MIN_ROWS = 32;

inline void widen_lines(const uint16_t* P, int k0, int kn, float* Wf) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int k = 0; k < kn; ++k) {
        const uint16_t* Pk = P + static_cast<int64_t>(k0 + k) * PANEL;
        float* Wk = Wf + static_cast<int64_t>(k) * PANEL;
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; ++hf) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Pk + 16 * hf));
            _mm256_store_ps(Wk + 8 * hf, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_store_ps(Wk + 16 + 8 * hf, _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask)));
        }
    }
}

// C[i][c0 + 0 .. 8 NV) += x[i][k0 + k] * Wf[k][c0 + ...] for MB rows; prefetches pf_n lines from
// pf on the way (the panel's next chunk, so that memory works while this chunk computes).
template <int MB, int NV>
inline void tile_f32(const float* Wf, int kn, const float* x0, int K, float* C, int c0, const uint16_t* pf, int pf_n) {
    static_assert(MB * NV <= 12, "accumulators must fit in 16 registers");
    __m256 acc[MB][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_load_ps(C + i * PANEL + c0 + 8 * v);
    for (int k = 0; k < kn; ++k) {
        if (k < pf_n) __builtin_prefetch(pf + static_cast<int64_t>(k) * PANEL, 0, 3);
        __m256 w[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) w[v] = _mm256_load_ps(Wf + static_cast<int64_t>(k) * PANEL + c0 + 8 * v);
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
            const __m256 xb = _mm256_broadcast_ss(x0 + static_cast<int64_t>(i) * K + k);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(w[v], xb, acc[i][v]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) _mm256_store_ps(C + i * PANEL + c0 + 8 * v, acc[i][v]);
}

// All M rows against one panel through the widened chunks; Wf holds KC * 32 floats, C M * 32
// (both 32-byte aligned).
void panel_task_f32(const uint16_t* P, const float* xf, const float* bias, void* y, int y_f32, int N, int K, int n0, int M, float* Wf, float* C) {
    std::fill(C, C + static_cast<int64_t>(M) * PANEL, 0.0f);
    int k0 = 0;
    if (K > 0) widen_lines(P, 0, std::min(KC, K), Wf);
    while (k0 < K) {
        const int kn = std::min(KC, K - k0);
        const int next = k0 + kn;
        const uint16_t* pf = P + static_cast<int64_t>(next) * PANEL;
        int pf_n = std::min(KC, K - next);
        const float* xk = xf + k0;
        int m0 = 0;
        for (; M - m0 >= 6; m0 += 6) {
            for (int c0 = 0; c0 < PANEL; c0 += 16) {
                tile_f32<6, 2>(Wf, kn, xk + static_cast<int64_t>(m0) * K, K, C + m0 * PANEL, c0, pf, pf_n);
                pf_n = 0;  // the first pass prefetches the next chunk
            }
        }
        if (M - m0 >= 4) {
            for (int c0 = 0; c0 < PANEL; c0 += 16) {
                tile_f32<4, 2>(Wf, kn, xk + static_cast<int64_t>(m0) * K, K, C + m0 * PANEL, c0, pf, pf_n);
                pf_n = 0;
            }
            m0 += 4;
        }
        if (M - m0 == 3) tile_f32<3, 4>(Wf, kn, xk + static_cast<int64_t>(m0) * K, K, C + m0 * PANEL, 0, pf, pf_n);
        if (M - m0 == 2) tile_f32<2, 4>(Wf, kn, xk + static_cast<int64_t>(m0) * K, K, C + m0 * PANEL, 0, pf, pf_n);
        if (M - m0 == 1) tile_f32<1, 4>(Wf, kn, xk + static_cast<int64_t>(m0) * K, K, C + m0 * PANEL, 0, pf, pf_n);
        k0 = next;
        if (k0 < K) widen_lines(P, k0, std::min(KC, K - k0), Wf);
    }
    const int valid = N - n0;
    for (int i = 0; i < M; ++i)
        for (int c0 = 0; c0 < PANEL; c0 += 8) {
            __m256 a = _mm256_load_ps(C + i * PANEL + c0);
            if (bias) {
                alignas(32) float ba[8] = {0};
                for (int t = 0; t < 8; ++t)
                    if (c0 + t < valid) ba[t] = bias[n0 + c0 + t];
                a = _mm256_add_ps(a, _mm256_load_ps(ba));
            }
            store8(y, y_f32, static_cast<int64_t>(i) * N + n0 + c0, a, valid - c0);
        }
}
#else
template <int MB, int KU>
void panel_rows(const uint16_t* P, const float* xf, const float* bias, void* y, int y_f32, int N, int K, int n0, int m0) {
    float out[MB][PANEL] = {};
    for (int k = 0; k < K; ++k)
        for (int j = 0; j < PANEL; ++j) {
            const float w = bf16_to_f32(P[static_cast<int64_t>(k) * PANEL + 2 * (j % 16) + j / 16]);
            for (int i = 0; i < MB; ++i) out[i][j] += w * xf[static_cast<int64_t>(m0 + i) * K + k];
        }
    const int valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int i = 0; i < MB; ++i) {
        if (bias)
            for (int j = 0; j < valid; ++j) out[i][j] += bias[n0 + j];
        store_row(y, y_f32, static_cast<int64_t>(m0 + i) * N + n0, valid, out[i]);
    }
}
#endif

// Prefetches the cache rows of heads [h0, h1) at position p of a sequence: blocks sit anywhere
// in the pool, so the hardware prefetcher, which follows one block's rows, stalls at every
// block boundary. Decode attention prefetches `ahead` positions on into L1 (a negative `ahead`:
// -ahead positions on, into L2 only; 0: not at all), a parameter because what pays differs by
// CPU (on AMD Zen 4 the L1 prefetches stall the loop, the L2 ones do not), so the kernel choice
// measures it (docs/SPEED.md).
inline void prefetch_line(const char* a, bool to_l2) {
    if (to_l2)
        __builtin_prefetch(a, 0, 2);
    else
        __builtin_prefetch(a, 0, 3);
}
inline void prefetch_heads(const void* cache, int elem, const int64_t* bt, int block_size, int64_t p, int KvH, int hd, int h0, int h1,
                           bool to_l2) {
    const int64_t slot = bt[p / block_size] * block_size + p % block_size;
    const char* a = static_cast<const char*>(cache) + (slot * KvH + h0) * static_cast<int64_t>(hd) * elem;
    const int64_t bytes = static_cast<int64_t>(h1 - h0) * hd * elem;
    for (int64_t off = 0; off < bytes; off += 64) prefetch_line(a + off, to_l2);
}


// A thread's side prefetch during decode attention (decode_layer's): its share of the weight
// the next GEMM reads (the o projection, as gemm_pairs_impl splits its panels), fetched into L2
// a few lines at each position the attention visits. At a few rows attention waits on its KV
// reads position by position and leaves the memory idle, while the o projection after it,
// started cold, streamed at about half the rate of the layer's other GEMMs (docs/SPEED.md,
// "Zen 4, a fifteenth session").
constexpr int SIDE_PREFETCH_ROWS = 1;  // decode_layer's side prefetch at up to this many rows
struct SidePrefetch {
    const char* next = nullptr;
    int64_t left = 0;  // bytes
    int lines = 0;     // at each position
    void step() {
        for (int i = 0; i < lines && left > 0; ++i, next += 64, left -= 64) __builtin_prefetch(next, 0, 2);
    }
};
thread_local SidePrefetch t_side;

// Slot of position p in a sequence's block table, advanced one position at a time (no division
// per position).
struct SlotCursor {
    const int64_t* bt;
    int64_t block_size, blk, off;
    SlotCursor(const int64_t* bt_, int64_t block_size_, int64_t p) : bt(bt_), block_size(block_size_), blk(p / block_size_), off(p % block_size_) {}
    int64_t slot() const { return bt[blk] * block_size + off; }
    void next() {
        if (++off == block_size) {
            off = 0;
            ++blk;
        }
    }
};

#if defined(__AVX512F__)
// r[j] = sum of the 16 lanes of v[j], for j = 0..15: a transpose-and-add tree (15 adds and 30
// shuffles for 16 sums, instead of ~8 dependent ops per sum).
inline __m512 hsum16(const __m512* v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a, b, a, b] partials of v[2i], v[2i + 1]
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial of each of v[4i .. 4i + 3]
        const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    for (int i = 0; i < 2; ++i)  // lanes 0, 1: v[8i .. 8i + 3]; lanes 2, 3: v[8i + 4 .. 8i + 7]
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One decode task of paged_decode_attention for a bf16 cache and head_dim 32 * NC: heads
// [h0, h1) of one sequence, keys [begin, end), q (f32, nq * hd, query heads of the task in
// order) -> out (f32, same layout). A 64-byte cache line of 32 bf16 widens into its even and its
// odd elements with one op each (as in the panel GEMM), so q and the output accumulators are kept
// split the same way; a score is finished 16 positions at a time by hsum16.
template <int NC>
void decode_task_bf16(const float* qd, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* bt, int block_size,
                      int64_t begin, int64_t end, int KvH, int G, int h0, int h1, float scale, int ahead_n, std::vector<float>& scores,
                      std::vector<float>& buf, float* outd, float* lse) {
    constexpr int hd = 32 * NC;
    const int nq = (h1 - h0) * G;
    const int64_t n = end - begin;
    const int64_t ldn = (n + 15) & ~int64_t(15);
    scores.assign(static_cast<size_t>(nq) * ldn, -INFINITY);
    // buf: q split [nq][NC][2], then per-query-head partial dot products [nq][16], then the
    // output accumulators [nq][NC][2]
    buf.resize(static_cast<size_t>(nq) * (4 * NC + 16) * 16 + 16);
    __m512* qs = reinterpret_cast<__m512*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    __m512* part = qs + nq * 2 * NC;
    __m512* acc = part + nq * 16;
    const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int qh = 0; qh < nq; ++qh)
        for (int c = 0; c < NC; ++c) {
            alignas(64) float e[16], o[16];
            for (int i = 0; i < 16; ++i) {
                e[i] = qd[qh * hd + 32 * c + 2 * i];
                o[i] = qd[qh * hd + 32 * c + 2 * i + 1];
            }
            qs[(qh * NC + c) * 2] = _mm512_load_ps(e);
            qs[(qh * NC + c) * 2 + 1] = _mm512_load_ps(o);
        }
    const int64_t row = static_cast<int64_t>(KvH) * hd;  // elements per slot
    // Visits heads [h0, h1) of every position in [begin, end) in order: visit(i, query head,
    // even lanes, odd lanes) for each query head of a KV head, then done(i) after a position;
    // the rows ahead_n positions on are prefetched.
    const bool to_l2 = ahead_n < 0;  // see prefetch_heads
    if (to_l2) ahead_n = -ahead_n;
    auto walk = [&](const uint16_t* cache, auto&& visit, auto&& done) {
        SlotCursor cur(bt, block_size, begin), ahead(bt, block_size, begin);
        for (int a = 0; a < ahead_n && begin + a < end; ++a) ahead.next();
        for (int64_t p = begin; p < end; ++p) {
            t_side.step();
            if (ahead_n > 0 && p + ahead_n < end) {
                const char* pf = reinterpret_cast<const char*>(cache + ahead.slot() * row + static_cast<int64_t>(h0) * hd);
                for (int64_t off = 0; off < static_cast<int64_t>(h1 - h0) * hd * 2; off += 64) prefetch_line(pf + off, to_l2);
                ahead.next();
            }
            const uint16_t* r = cache + cur.slot() * row;
            cur.next();
            for (int h = h0; h < h1; ++h) {
                __m512 lo[NC], hi[NC];
                for (int c = 0; c < NC; ++c) {
                    const __m512i v = _mm512_loadu_si512(r + h * hd + 32 * c);
                    lo[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                    hi[c] = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
                }
                for (int g = 0; g < G; ++g) visit(p - begin, (h - h0) * G + g, lo, hi);
            }
            done(p - begin);
        }
    };
    // Pass 1: scores[qh, p] = q_qh . k_p * scale.
    walk(
        k_cache,
        [&](int64_t i, int qh, const __m512* lo, const __m512* hi) {
            const __m512* qq = qs + qh * NC * 2;
            __m512 s0 = _mm512_mul_ps(lo[0], qq[0]), s1 = _mm512_mul_ps(hi[0], qq[1]);
            for (int c = 1; c < NC; ++c) {
                s0 = _mm512_fmadd_ps(lo[c], qq[2 * c], s0);
                s1 = _mm512_fmadd_ps(hi[c], qq[2 * c + 1], s1);
            }
            part[qh * 16 + (i & 15)] = _mm512_add_ps(s0, s1);
        },
        [&](int64_t i) {
            if ((i & 15) != 15 && i + 1 != n) return;
            const int valid = static_cast<int>(i & 15) + 1;
            const __m512 sc = _mm512_set1_ps(scale);
            for (int qh = 0; qh < nq; ++qh) {
                for (int j = valid; j < 16; ++j) part[qh * 16 + j] = _mm512_setzero_ps();
                _mm512_mask_storeu_ps(scores.data() + qh * ldn + (i & ~int64_t(15)), static_cast<__mmask16>((1u << valid) - 1),
                                      _mm512_mul_ps(hsum16(part + qh * 16), sc));
            }
        });
    for (int qh = 0; qh < nq; ++qh) {
        const float l = softmax_inplace(scores.data() + qh * ldn, n, ldn);
        if (lse != nullptr) lse[qh] = l;
    }
    // Pass 2: out_qh = sum_p scores[qh, p] * v_p.
    for (int j = 0; j < nq * 2 * NC; ++j) acc[j] = _mm512_setzero_ps();
    walk(
        v_cache,
        [&](int64_t i, int qh, const __m512* lo, const __m512* hi) {
            const __m512 w = _mm512_set1_ps(scores[qh * ldn + i]);
            __m512* aq = acc + qh * NC * 2;
            for (int c = 0; c < NC; ++c) {
                aq[2 * c] = _mm512_fmadd_ps(lo[c], w, aq[2 * c]);
                aq[2 * c + 1] = _mm512_fmadd_ps(hi[c], w, aq[2 * c + 1]);
            }
        },
        [](int64_t) {});
    for (int qh = 0; qh < nq; ++qh)
        for (int c = 0; c < NC; ++c) {
            alignas(64) float e[16], o[16];
            _mm512_store_ps(e, acc[(qh * NC + c) * 2]);
            _mm512_store_ps(o, acc[(qh * NC + c) * 2 + 1]);
            for (int i = 0; i < 16; ++i) {
                outd[qh * hd + 32 * c + 2 * i] = e[i];
                outd[qh * hd + 32 * c + 2 * i + 1] = o[i];
            }
        }
}

using DecodeTask = void (*)(const float*, const uint16_t*, const uint16_t*, const int64_t*, int, int64_t, int64_t, int, int, int, int, float,
                            int, std::vector<float>&, std::vector<float>&, float*, float*);
inline DecodeTask decode_task_for(int hd) {
    switch (hd) {
        case 32: return decode_task_bf16<1>;
        case 64: return decode_task_bf16<2>;
        case 96: return decode_task_bf16<3>;
        case 128: return decode_task_bf16<4>;
        case 256: return decode_task_bf16<8>;
        default: return nullptr;
    }
}
#endif

#if defined(ITERSERVE_AVX2)
// r[j] = sum of the 8 lanes of v[j], for j = 0..7 (the 8-lane hsum16).
inline __m256 hsum8x8(const __m256* v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit lane: v[0..3], v[4..7]
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// decode_task_bf16 in 8 lanes, head_dim 16 * NC: a 32-byte half line of 16 bf16 widens into its
// even and odd elements with one op each, and a score is finished 8 positions at a time by
// hsum8x8 (the generic path's one horizontal sum per score and head cost ~3x the dot product).
template <int NC>
void decode_task_avx2(const float* qd, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* bt, int block_size,
                      int64_t begin, int64_t end, int KvH, int G, int h0, int h1, float scale, int ahead_n, std::vector<float>& scores,
                      std::vector<float>& buf, float* outd, float* lse) {
    constexpr int hd = 16 * NC;
    const int nq = (h1 - h0) * G;
    const int64_t n = end - begin;
    const int64_t ldn = (n + 15) & ~int64_t(15);
    scores.assign(static_cast<size_t>(nq) * ldn, -INFINITY);
    // buf: q split [nq][NC][2], per-query-head partial dot products [nq][8], output accumulators
    // [nq][NC][2], in 8-float vectors
    buf.resize(static_cast<size_t>(nq) * (4 * NC + 8) * 8 + 8);
    __m256* qs = reinterpret_cast<__m256*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t(31));
    __m256* part = qs + nq * 2 * NC;
    __m256* acc = part + nq * 8;
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int qh = 0; qh < nq; ++qh)
        for (int c = 0; c < NC; ++c) {
            alignas(32) float e[8], o[8];
            for (int i = 0; i < 8; ++i) {
                e[i] = qd[qh * hd + 16 * c + 2 * i];
                o[i] = qd[qh * hd + 16 * c + 2 * i + 1];
            }
            qs[(qh * NC + c) * 2] = _mm256_load_ps(e);
            qs[(qh * NC + c) * 2 + 1] = _mm256_load_ps(o);
        }
    const int64_t row = static_cast<int64_t>(KvH) * hd;  // elements per slot
    const bool to_l2 = ahead_n < 0;  // see prefetch_heads
    if (to_l2) ahead_n = -ahead_n;
    auto walk = [&](const uint16_t* cache, auto&& visit, auto&& done) {
        SlotCursor cur(bt, block_size, begin), ahead(bt, block_size, begin);
        for (int a = 0; a < ahead_n && begin + a < end; ++a) ahead.next();
        for (int64_t p = begin; p < end; ++p) {
            t_side.step();
            if (ahead_n > 0 && p + ahead_n < end) {
                const char* pf = reinterpret_cast<const char*>(cache + ahead.slot() * row + static_cast<int64_t>(h0) * hd);
                for (int64_t off = 0; off < static_cast<int64_t>(h1 - h0) * hd * 2; off += 64) prefetch_line(pf + off, to_l2);
                ahead.next();
            }
            const uint16_t* r = cache + cur.slot() * row;
            cur.next();
            for (int h = h0; h < h1; ++h) {
                __m256 lo[NC], hi[NC];
                for (int c = 0; c < NC; ++c) {
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + h * hd + 16 * c));
                    lo[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    hi[c] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                }
                for (int g = 0; g < G; ++g) visit(p - begin, (h - h0) * G + g, lo, hi);
            }
            done(p - begin);
        }
    };
    // Pass 1: scores[qh, p] = q_qh . k_p * scale.
    walk(
        k_cache,
        [&](int64_t i, int qh, const __m256* lo, const __m256* hi) {
            const __m256* qq = qs + qh * NC * 2;
            __m256 s0 = _mm256_mul_ps(lo[0], qq[0]), s1 = _mm256_mul_ps(hi[0], qq[1]);
            for (int c = 1; c < NC; ++c) {
                s0 = _mm256_fmadd_ps(lo[c], qq[2 * c], s0);
                s1 = _mm256_fmadd_ps(hi[c], qq[2 * c + 1], s1);
            }
            part[qh * 8 + (i & 7)] = _mm256_add_ps(s0, s1);
        },
        [&](int64_t i) {
            if ((i & 7) != 7 && i + 1 != n) return;
            const int valid = static_cast<int>(i & 7) + 1;
            const __m256 sc = _mm256_set1_ps(scale);
            for (int qh = 0; qh < nq; ++qh) {
                for (int j = valid; j < 8; ++j) part[qh * 8 + j] = _mm256_setzero_ps();
                alignas(32) float r8[8];
                _mm256_store_ps(r8, _mm256_mul_ps(hsum8x8(part + qh * 8), sc));
                std::memcpy(scores.data() + qh * ldn + (i & ~int64_t(7)), r8, sizeof(float) * valid);
            }
        });
    for (int qh = 0; qh < nq; ++qh) {
        const float l = softmax_inplace(scores.data() + qh * ldn, n, ldn);
        if (lse != nullptr) lse[qh] = l;
    }
    // Pass 2: out_qh = sum_p scores[qh, p] * v_p.
    for (int j = 0; j < nq * 2 * NC; ++j) acc[j] = _mm256_setzero_ps();
    walk(
        v_cache,
        [&](int64_t i, int qh, const __m256* lo, const __m256* hi) {
            const __m256 w = _mm256_set1_ps(scores[qh * ldn + i]);
            __m256* aq = acc + qh * NC * 2;
            for (int c = 0; c < NC; ++c) {
                aq[2 * c] = _mm256_fmadd_ps(lo[c], w, aq[2 * c]);
                aq[2 * c + 1] = _mm256_fmadd_ps(hi[c], w, aq[2 * c + 1]);
            }
        },
        [](int64_t) {});
    for (int qh = 0; qh < nq; ++qh)
        for (int c = 0; c < NC; ++c) {
            alignas(32) float e[8], o[8];
            _mm256_store_ps(e, acc[(qh * NC + c) * 2]);
            _mm256_store_ps(o, acc[(qh * NC + c) * 2 + 1]);
            for (int i = 0; i < 8; ++i) {
                outd[qh * hd + 16 * c + 2 * i] = e[i];
                outd[qh * hd + 16 * c + 2 * i + 1] = o[i];
            }
        }
}

using DecodeTask = void (*)(const float*, const uint16_t*, const uint16_t*, const int64_t*, int, int64_t, int64_t, int, int, int, int, float,
                            int, std::vector<float>&, std::vector<float>&, float*, float*);
inline DecodeTask decode_task_for(int hd) {
    switch (hd) {
        case 16: return decode_task_avx2<1>;
        case 32: return decode_task_avx2<2>;
        case 64: return decode_task_avx2<4>;
        case 96: return decode_task_avx2<6>;
        case 128: return decode_task_avx2<8>;
        case 256: return decode_task_avx2<16>;
        default: return nullptr;
    }
}
#endif

#if defined(ITERSERVE_AVX2)
// --- Causal prefill attention over the paged cache, f32 FMA (AVX2 without AVX-512) ----------
// The AVX512-BF16 kernel below in 8-lane f32: this CPU has no bf16 dot products, so K and V
// are widened to f32 once per call (K per 16 keys as [hd][16 keys], V as [key][hd]) and P stays
// f32. Against torch's SDPA on the same values (f32, since bf16 is emulated here) it widens the
// keys straight from the paged cache (that f32 copy is its only one: no gather into a bf16
// copy first, no upcast of it) and builds no mask tensor for a continued chunk.
constexpr int PA_KB = 64;   // keys per block
constexpr int PA_QB = 96;   // query rows per task
constexpr int PA_R = 6;     // query rows per register tile: 12 accumulators of 16 keys or columns
constexpr float PA_LAZY = 8.f;  // natural-log units the row max may lag behind (P <= e^8)

// Rows [r0, r1) (at most PA_QB) of query head h against its KV head's widened Kp / Vp (keys
// padded to a multiple of PA_KB with zeros). Qf, O: scratch for r1 - r0 + PA_R rows of hd
// floats, m for as many rows, l 8 per row (a short last tile computes duplicates of its last
// row into the spare rows, never stored).
void prefill_task_avx2(const uint16_t* q, int64_t q_stride, const float* Kp, const float* Vp, int h, int r0, int r1, int p0,
                       int hd, float scale, uint16_t* out, int64_t out_stride, float* Qf, float* O, float* m, float* l) {
    const int nrows = r1 - r0;
    // The scale goes into q, so a score is one dot product: the row max is then one of the
    // scores exactly and its key's P exactly e^0 (a separately rounded product would leave up to
    // half an ulp of a huge score, enough for e^x to under- or overflow).
    const __m256 sc = _mm256_set1_ps(scale);
    for (int i = 0; i < nrows + PA_R; ++i) {
        const uint16_t* src = q + static_cast<int64_t>(r0 + std::min(i, nrows - 1)) * q_stride + static_cast<int64_t>(h) * hd;
        for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(Qf + static_cast<int64_t>(i) * hd + d, _mm256_mul_ps(widen8(src + d), sc));
        m[i] = -INFINITY;
    }
    std::memset(l, 0, sizeof(float) * 8 * static_cast<size_t>(nrows + PA_R));
    std::memset(O, 0, sizeof(float) * static_cast<size_t>(nrows + PA_R) * hd);
    const int last_key = p0 + r1 - 1;
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    alignas(32) float S[PA_R][PA_KB];
    for (int k0 = 0; k0 <= last_key; k0 += PA_KB) {
        const float* kblk = Kp + static_cast<int64_t>(k0) * hd;
        const float* vblk = Vp + static_cast<int64_t>(k0) * hd;
        for (int t0 = 0; t0 < nrows; t0 += PA_R) {
            if (k0 > p0 + r0 + std::min(t0 + PA_R, nrows) - 1) continue;  // no row of the tile sees this block yet
            const float* qt = Qf + static_cast<int64_t>(t0) * hd;
            // On the diagonal block the tile's rows see only the first ng groups of 16 keys; the
            // rest are masked below (their stale S too) and their P is 0, so no product runs on
            // them.
            const int ng = std::min(PA_KB / 16, (p0 + r0 + std::min(t0 + PA_R, nrows) - 1 - k0) / 16 + 1);
            // S = Q K^T, 16 keys at a time
            for (int g = 0; g < ng; ++g) {
                const float* kg = kblk + static_cast<int64_t>(g) * 16 * hd;
                __m256 acc[PA_R][2];
                for (int r = 0; r < PA_R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
                for (int d = 0; d < hd; ++d) {
                    const __m256 k0v = _mm256_loadu_ps(kg + 16 * d), k1v = _mm256_loadu_ps(kg + 16 * d + 8);
#pragma GCC unroll 6
                    for (int r = 0; r < PA_R; ++r) {
                        const __m256 qb = _mm256_broadcast_ss(qt + static_cast<int64_t>(r) * hd + d);
                        acc[r][0] = _mm256_fmadd_ps(qb, k0v, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(qb, k1v, acc[r][1]);
                    }
                }
                for (int r = 0; r < PA_R; ++r) {
                    _mm256_store_ps(S[r] + 16 * g, acc[r][0]);
                    _mm256_store_ps(S[r] + 16 * g + 8, acc[r][1]);
                }
            }
            // Softmax with a lazily raised row max (as the bf16 kernel): m moves only when a
            // block's max passes it by more than PA_LAZY, so most blocks need neither a
            // horizontal max nor a rescale of O; O / l is the same quotient.
            float corr[PA_R];
            bool rescale = false;
            for (int r = 0; r < PA_R; ++r) {
                const int i = t0 + r;
                const int pos = p0 + r0 + std::min(i, nrows - 1);
                const bool diag = k0 + PA_KB - 1 > pos;  // hide keys past the query
                __m256 mx = ninf;
                for (int c = 0; c < PA_KB / 8; ++c) {
                    __m256 s = _mm256_load_ps(S[r] + 8 * c);
                    if (diag) {
                        const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(k0 + 8 * c));
                        s = _mm256_blendv_ps(s, ninf, _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, _mm256_set1_epi32(pos))));
                        _mm256_store_ps(S[r] + 8 * c, s);
                    }
                    mx = _mm256_max_ps(mx, s);
                }
                // A row may see none of this block's keys (a tile straddling the block's start):
                // its max is -inf, m stays and P is 0.
                float m_new = m[i];
                if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(m[i] + PA_LAZY), _CMP_GT_OQ))) m_new = hmax8(mx);
                const __m256 mv = _mm256_set1_ps(m_new);
                __m256 sum = _mm256_setzero_ps();
                for (int c = 0; c < PA_KB / 8; ++c) {
                    const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(S[r] + 8 * c), mv));
                    _mm256_store_ps(S[r] + 8 * c, p);
                    sum = _mm256_add_ps(sum, p);
                }
                __m256 lv = _mm256_loadu_ps(l + 8 * i);
                corr[r] = 1.f;
                if (m_new != m[i]) {
                    corr[r] = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
                    lv = _mm256_mul_ps(lv, _mm256_set1_ps(corr[r]));
                    rescale = true;
                }
                _mm256_storeu_ps(l + 8 * i, _mm256_add_ps(lv, sum));
                m[i] = m_new;
            }
            // O[i] = O[i] * corr + P[i] . V, 16 output columns at a time
            for (int e0 = 0; e0 < hd; e0 += 16) {
                __m256 o[PA_R][2];
                for (int r = 0; r < PA_R; ++r) {
                    float* orow = O + static_cast<int64_t>(t0 + r) * hd + e0;
                    o[r][0] = _mm256_loadu_ps(orow);
                    o[r][1] = _mm256_loadu_ps(orow + 8);
                    if (rescale) {
                        const __m256 cv = _mm256_set1_ps(corr[r]);
                        o[r][0] = _mm256_mul_ps(o[r][0], cv);
                        o[r][1] = _mm256_mul_ps(o[r][1], cv);
                    }
                }
                for (int j = 0; j < 16 * ng; ++j) {
                    const __m256 v0 = _mm256_loadu_ps(vblk + static_cast<int64_t>(j) * hd + e0);
                    const __m256 v1 = _mm256_loadu_ps(vblk + static_cast<int64_t>(j) * hd + e0 + 8);
#pragma GCC unroll 6
                    for (int r = 0; r < PA_R; ++r) {
                        const __m256 pb = _mm256_broadcast_ss(S[r] + j);
                        o[r][0] = _mm256_fmadd_ps(pb, v0, o[r][0]);
                        o[r][1] = _mm256_fmadd_ps(pb, v1, o[r][1]);
                    }
                }
                for (int r = 0; r < PA_R; ++r) {
                    float* orow = O + static_cast<int64_t>(t0 + r) * hd + e0;
                    _mm256_storeu_ps(orow, o[r][0]);
                    _mm256_storeu_ps(orow + 8, o[r][1]);
                }
            }
        }
    }
    for (int i = 0; i < nrows; ++i) {
        const __m256 inv = _mm256_set1_ps(1.f / hsum8(_mm256_loadu_ps(l + 8 * i)));
        uint16_t* dst = out + static_cast<int64_t>(r0 + i) * out_stride + static_cast<int64_t>(h) * hd;
        for (int e = 0; e < hd; e += 8) narrow8(dst + e, _mm256_mul_ps(_mm256_loadu_ps(O + static_cast<int64_t>(i) * hd + e), inv));
    }
}
#endif

#if defined(__AVX512BF16__)
// --- Causal prefill attention over the paged cache (bf16, AVX512-BF16 dot products) ----------
// One chunk of n queries (positions p0 .. p0 + n - 1) against keys 0 .. p0 + n - 1, flash
// style: keys in blocks of PF_KB with a running max and sum per query row, so the scores stay
// in registers. K and V are first copied out of the cache into the pair layout vdpbf16ps
// takes: K per 16 keys as [hd / 2][16 keys][2], V per 2 keys as [hd][2]. Scores and the output
// accumulate in f32; P is rounded to bf16 for P.V, as torch's flash attention does.
constexpr int PF_KB = 64;  // keys per block: 4 vectors of scores per row
constexpr int PF_QB = 96;  // query rows per task (16 tiles)
constexpr int PF_R = 6;    // query rows per register tile: 24 accumulators (6 beat 4 by ~1.3x)
constexpr float PF_LAZY = 8.f;  // log2 units the row max may lag behind (P <= 256)

// Denormal results flushed to zero, denormal inputs read as zero, for the scope of one thread's
// share of a kernel: 2^x of a masked key (-inf) or of one far below the row max underflows, and
// each such underflow costs a microcode assist (vscalefps in exp2_ps, the rescale of a row's
// first block; docs/SPEED.md, "The prefill kernel flushes denormals"). Nothing here is near
// 1e-38 in magnitude that matters to a bf16 result.
struct FlushDenormals {
    unsigned saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
    ~FlushDenormals() { _mm_setcsr(saved); }
    FlushDenormals(const FlushDenormals&) = delete;
    FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// r[j] = column j of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15].
inline void transpose16x16_epi32(__m512i (&r)[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + k
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; ++k) {  // column 4L + k gathers lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
        const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), y1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

inline __m512bh pair_bcast(const uint16_t* p) {  // the bf16 pair at p, in every 32-bit lane
    int32_t w;
    std::memcpy(&w, p, 4);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(w));
}

inline __m512bh load_bh(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

// 2^x for x <= 0, for a P that is rounded to bf16 next: x = n + r, |r| <= 1/2 (vreduceps), 2^r by
// a degree-3 minimax polynomial (relative error 2.2e-4, a tenth of bf16's half ulp), times 2^n
// by vscalefps. -inf gives 0 (vreduceps makes r 0, n -inf); results below 2^-126 are denormal,
// which the callers' FlushDenormals makes 0. Six operations against exp2_ps's ten: the AMX
// attention's softmax is bound by them, and the dot-product kernel's shares the FMA pipes with
// vdpbf16ps (a Zen 4 layer at 2,048 queries: 20.6-20.9 -> 19.9 ms).
inline __m512 exp2_bf16(__m512 x) {
    const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // x - nearest integer
    __m512 p = _mm512_set1_ps(0.05286732f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24215214f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6935868f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.99996275f));
    return _mm512_scalef_ps(p, _mm512_sub_ps(x, r));
}

#if defined(ITERSERVE_AMX)
bool amx_permitted() {
    // Linux hands out the tiles' 8 KiB of register state only to a process that asks once.
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
#endif

// One query row's block of PF_KB scores s (q . k, unscaled; 4 vectors) at position pos, keys from
// k0: softmax in base 2 (t = s * scale * log2 e, sl) with a lazily raised row max: m moves only
// when the block's max passes it by more than PF_LAZY (exact max then), so most blocks need
// neither a horizontal max nor a rescale; P = 2^(t - m) <= 2^PF_LAZY stays far inside f32 and
// bf16 range, and O / l is the same quotient. P is rounded to bf16 and stored at pb (PF_KB
// values, 64-byte aligned) and returned as p01 / p23. Returns whether m moved; corr is then the
// factor the row's O and l take (2^(m_old - m_new)), else 1. The prefill kernels' shared step.
template <typename Exp2>
inline bool softmax_block_row(__m512 (&s)[4], __m512 sl, int k0, int pos, float& m, uint16_t* pb, __m512i& p01, __m512i& p23, __m512& corr,
                              Exp2 exp2) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // t rounded once, so m is one of the t and its key's P exactly 2^0 (an exact fmsub against a
    // rounded m leaves up to half an ulp of m, which for scores near 1e9 alone under- or
    // overflows 2^x); explicit rounding keeps the compiler from fusing the multiply into the
    // subtract.
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; ++c) {
        s[c] = _mm512_mul_round_ps(s[c], sl, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (k0 + PF_KB - 1 > pos) {  // the diagonal block: hide keys past the query
            const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(k0 + 16 * c));
            const __mmask16 ok = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos));
            s[c] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), s[c]);
        }
        mx = _mm512_max_ps(mx, s[c]);
    }
    // A row may see none of this block's keys (a tile straddling the block's start): its max is
    // -inf, m stays and P is 0.
    float m_new = m;
    if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m + PF_LAZY), _CMP_GT_OQ)) m_new = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m_new);
    for (int c = 0; c < 4; ++c) s[c] = exp2(_mm512_sub_ps(s[c], mv));
    p01 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(s[1], s[0]));
    p23 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(s[3], s[2]));
    _mm512_storeu_si512(pb, p01);
    _mm512_storeu_si512(pb + 32, p23);
    if (m_new == m) {
        corr = _mm512_set1_ps(1.f);
        return false;
    }
    corr = exp2_ps(_mm512_set1_ps(m - m_new));
    m = m_new;
    return true;
}

// f(std::integral_constant<int, n>) for n = 1..4: loops over n groups of 16 keys unrolled.
template <typename F>
inline void with_groups(int n, F&& f) {
    switch (n) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        default: f(std::integral_constant<int, 4>{}); break;
    }
}

// Rows [r0, r1) (at most PF_QB) of query head h against its KV head's packed Kp / Vp (keys
// padded to a multiple of PF_KB with zeros). O, m, l: scratch for r1 - r0 + PF_R rows (a short
// last tile computes duplicates of its last row into the spare slots, never stored); l holds 16
// partial sums per row.
void prefill_task(const uint16_t* q, int64_t q_stride, const uint16_t* Kp, const uint16_t* Vp, int h, int r0, int r1, int p0,
                  int hd, float scale, uint16_t* out, int64_t out_stride, float* O, float* m, float* l) {
    const int nrows = r1 - r0;
    for (int i = 0; i < nrows + PF_R; ++i) m[i] = -INFINITY;
    std::memset(l, 0, sizeof(float) * 16 * static_cast<size_t>(nrows + PF_R));
    std::memset(O, 0, sizeof(float) * static_cast<size_t>(nrows + PF_R) * hd);
    const int hp = hd / 2;
    const int last_key = p0 + r1 - 1;
    const __m512 sl = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // bf16 1.0
    alignas(64) uint16_t Pb[PF_R][PF_KB];
    for (int k0 = 0; k0 <= last_key; k0 += PF_KB) {
        const uint16_t* kblk = Kp + static_cast<int64_t>(k0) * hd;
        const uint16_t* vblk = Vp + static_cast<int64_t>(k0) * hd;
        for (int t0 = 0; t0 < nrows; t0 += PF_R) {
            int row[PF_R];
            for (int k = 0; k < PF_R; ++k) row[k] = r0 + (t0 + k < nrows ? t0 + k : nrows - 1);
            if (k0 > p0 + row[PF_R - 1]) continue;  // no row of the tile sees this block yet
            const uint16_t* qrow[PF_R];
            __m512 s[PF_R][4];
            for (int k = 0; k < PF_R; ++k) {
                qrow[k] = q + row[k] * q_stride + static_cast<int64_t>(h) * hd;
                for (int c = 0; c < 4; ++c) s[k][c] = _mm512_setzero_ps();
            }
            // On the diagonal block the tile's rows see only the first nc groups of 16 keys; the
            // rest are masked (scores -inf, P 0), so neither product runs on them (a short chunk
            // spends much of its time on diagonal blocks).
            const int nc = std::min(4, (p0 + row[PF_R - 1] - k0) / 16 + 1);
            with_groups(nc, [&](auto groups) {
                constexpr int NC = decltype(groups)::value;
                for (int d = 0; d < hp; ++d) {
                    __m512bh kv[NC];
                    for (int c = 0; c < NC; ++c) kv[c] = load_bh(kblk + (static_cast<int64_t>(c) * hp + d) * 32);
                    for (int k = 0; k < PF_R; ++k) {
                        const __m512bh qb = pair_bcast(qrow[k] + 2 * d);
                        for (int c = 0; c < NC; ++c) s[k][c] = _mm512_dpbf16_ps(s[k][c], qb, kv[c]);
                    }
                }
            });
            __m512 corr[PF_R];
            bool rescale = false;
            for (int k = 0; k < PF_R; ++k) {
                const int i = t0 + k;
                __m512i p01, p23;
                const bool moved = softmax_block_row(s[k], sl, k0, p0 + row[k], m[i], Pb[k], p01, p23, corr[k],
                                                     [](__m512 v) { return exp2_bf16(v); });
                // l sums the bf16-rounded P that O gets, so numerator and denominator agree (the
                // max key's P is not 1 when m lags). 2^(-inf) on the first block is 0. The row
                // sum stays 16 lanes wide until the end, so no horizontal add per block; P's
                // pairs go in as dot products with ones, two operations where widening and
                // adding them took seven.
                __m512 lv = _mm512_loadu_ps(l + 16 * i);
                if (moved) {
                    lv = _mm512_mul_ps(lv, corr[k]);
                    rescale = true;
                }
                lv = _mm512_dpbf16_ps(lv, reinterpret_cast<__m512bh>(p01), ones);
                _mm512_storeu_ps(l + 16 * i, _mm512_dpbf16_ps(lv, reinterpret_cast<__m512bh>(p23), ones));
            }
            // O[i] = O[i] * corr + P[i] . V, 64 output columns at a time.
            for (int e0 = 0; e0 < hd; e0 += 64) {
                __m512 o[PF_R][4];
                for (int k = 0; k < PF_R; ++k)
                    for (int c = 0; c < 4; ++c) {
                        o[k][c] = _mm512_loadu_ps(O + static_cast<int64_t>(t0 + k) * hd + e0 + 16 * c);
                        if (rescale) o[k][c] = _mm512_mul_ps(o[k][c], corr[k]);
                    }
                for (int j = 0; j < 8 * nc; ++j) {
                    __m512bh vv[4];
                    for (int c = 0; c < 4; ++c) vv[c] = load_bh(vblk + (static_cast<int64_t>(j) * hd + e0 + 16 * c) * 2);
                    for (int k = 0; k < PF_R; ++k) {
                        const __m512bh pb = pair_bcast(Pb[k] + 2 * j);
                        for (int c = 0; c < 4; ++c) o[k][c] = _mm512_dpbf16_ps(o[k][c], pb, vv[c]);
                    }
                }
                for (int k = 0; k < PF_R; ++k)
                    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(O + static_cast<int64_t>(t0 + k) * hd + e0 + 16 * c, o[k][c]);
            }
        }
    }
    for (int i = 0; i < nrows; ++i) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * i)));
        uint16_t* dst = out + static_cast<int64_t>(r0 + i) * out_stride + static_cast<int64_t>(h) * hd;
        for (int e = 0; e < hd; e += 16) narrow16(dst + e, _mm512_mul_ps(_mm512_loadu_ps(O + static_cast<int64_t>(i) * hd + e), inv));
    }
}

#if defined(ITERSERVE_AMX)
// prefill_task on AMX tiles: scores for 32 query rows at a time, the rest for 16. The packed K of 16 keys is already the
// B tile of Q . K^T ([hd / 2 pairs][16 keys][2]), and the packed V of 32 keys the B tile of P . V
// ([16 key pairs][hd][2], 16 columns a tile); the softmax between them is prefill_task's (base 2,
// lazily raised max, P rounded to bf16, l summing the rounded P), on S stored from the tiles, with
// a cheaper 2^x (exp2_bf16): on an AMX Xeon exp2_ps took 4 of the 13 ms a 2,048-token layer.
// Tiles, all 16 rows x 64 bytes: C 0-3 (S, or 64 columns of O), A 4-5 (Q, or P), B 6-7 (K, or V).
// Qb: (PF_QB + 32) x hd bf16 scratch; S: 2 x 32 x PF_KB f32; Pb: 16 x PF_KB bf16.
void prefill_task_amx(const uint16_t* q, int64_t q_stride, const uint16_t* Kp, const uint16_t* Vp, int h, int r0, int r1, int p0,
                      int hd, float scale, uint16_t* out, int64_t out_stride, float* O, float* m, float* l, uint16_t* Qb, float* S,
                      uint16_t* Pb) {
    const int nrows = r1 - r0;
    const int padded = (nrows + 31) / 32 * 32;  // score tiles of 32 rows
    const int held = (nrows + 15) / 16 * 16;     // softmax and P . V in 16
    for (int i = 0; i < held; ++i) m[i] = -INFINITY;
    std::memset(l, 0, sizeof(float) * 16 * static_cast<size_t>(held));
    std::memset(O, 0, sizeof(float) * static_cast<size_t>(held) * hd);
    std::memset(Pb, 0, sizeof(uint16_t) * 16 * PF_KB);  // rows past nrows stay 0
    for (int i = 0; i < padded; ++i) {  // Q rows, zero past nrows
        uint16_t* dst = Qb + static_cast<int64_t>(i) * hd;
        if (i < nrows)
            std::memcpy(dst, q + (r0 + i) * q_stride + static_cast<int64_t>(h) * hd, sizeof(uint16_t) * hd);
        else
            std::memset(dst, 0, sizeof(uint16_t) * hd);
    }
    const int last_key = p0 + r1 - 1;
    const __m512 sl = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // bf16 1.0
    const int64_t ldq = static_cast<int64_t>(hd) * 2, ldo = static_cast<int64_t>(hd) * 4;
    for (int k0 = 0; k0 <= last_key; k0 += PF_KB) {
        const uint16_t* kblk = Kp + static_cast<int64_t>(k0) * hd;
        const uint16_t* vblk = Vp + static_cast<int64_t>(k0) * hd;
        // S = Q . K^T for 64 keys and the 32 query rows from t0, into Sb [32][PF_KB]: two passes of
        // 32 keys, each 2 x 2 tiles (rows 0-15 / 16-31 x keys 0-15 / 16-31), so each loaded A and
        // B tile feeds two products and no tile is reloaded right behind the product reading it.
        auto scores = [&](int t0, float* Sb) {
            const uint16_t* qa = Qb + static_cast<int64_t>(t0) * hd;
            for (int half = 0; half < 2; ++half) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t* kh = kblk + static_cast<int64_t>(32 * half) * hd;
                for (int c = 0; c < hd / 32; ++c) {
                    _tile_loadd(4, qa + 32 * c, ldq);
                    _tile_loadd(5, qa + 16 * hd + 32 * c, ldq);
                    _tile_loadd(6, kh + c * 512, 64);  // 16 pairs of 16 keys
                    _tile_loadd(7, kh + 16 * hd + c * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                float* sh = Sb + 32 * half;
                _tile_stored(0, sh, PF_KB * 4);
                _tile_stored(1, sh + 16, PF_KB * 4);
                _tile_stored(2, sh + 16 * PF_KB, PF_KB * 4);
                _tile_stored(3, sh + 16 * PF_KB + 16, PF_KB * 4);
            }
        };
        // the softmax of row tile t0's scores Sb into Pb, m, l (O rescaled), then O += P . V
        auto update = [&](int t0, const float* Sb) {
            const int rows = std::min(16, nrows - t0);
            for (int k = 0; k < rows; ++k) {
                const int i = t0 + k;
                __m512 s[4];
                for (int c = 0; c < 4; ++c) s[c] = _mm512_load_ps(Sb + k * PF_KB + 16 * c);
                __m512i p01, p23;
                __m512 corr;
                __m512 lv = _mm512_loadu_ps(l + 16 * i);
                if (softmax_block_row(s, sl, k0, p0 + r0 + i, m[i], Pb + k * PF_KB, p01, p23, corr, [](__m512 v) { return exp2_bf16(v); })) {
                    lv = _mm512_mul_ps(lv, corr);
                    float* o = O + static_cast<int64_t>(i) * hd;
                    for (int e = 0; e < hd; e += 16) _mm512_storeu_ps(o + e, _mm512_mul_ps(_mm512_loadu_ps(o + e), corr));
                }
                // l sums the bf16 P, two at a time in one dot product against ones
                lv = _mm512_dpbf16_ps(lv, reinterpret_cast<__m512bh>(p01), ones);
                _mm512_storeu_ps(l + 16 * i, _mm512_dpbf16_ps(lv, reinterpret_cast<__m512bh>(p23), ones));
            }
            // O += P . V, 64 output columns at a time
            for (int e0 = 0; e0 < hd; e0 += 64) {
                float* o = O + static_cast<int64_t>(t0) * hd + e0;
                _tile_loadd(0, o, ldo);
                _tile_loadd(1, o + 16, ldo);
                _tile_loadd(2, o + 32, ldo);
                _tile_loadd(3, o + 48, ldo);
                _tile_loadd(4, Pb, PF_KB * 2);
                _tile_loadd(5, Pb + 32, PF_KB * 2);
                for (int c = 0; c < 4; ++c) {
                    const uint16_t* v = vblk + (e0 + 16 * c) * 2;  // keys k0 .. k0 + 31, then + 32
                    _tile_loadd(6, v, ldo);
                    _tile_loadd(7, v + 32 * static_cast<int64_t>(hd), ldo);
                    switch (c) {  // tile numbers are immediates
                        case 0: _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 7); break;
                        case 1: _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(1, 5, 7); break;
                        case 2: _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 7); break;
                        default: _tile_dpbf16ps(3, 4, 6); _tile_dpbf16ps(3, 5, 7); break;
                    }
                }
                _tile_stored(0, o, ldo);
                _tile_stored(1, o + 16, ldo);
                _tile_stored(2, o + 32, ldo);
                _tile_stored(3, o + 48, ldo);
            }
        };
        // Each 16-row half of a 32-row tile whose rows see this block.
        auto update32 = [&](int t0, const float* Sb) {
            for (int u = 0; u < 2; ++u)
                if (t0 + 16 * u < nrows && k0 <= p0 + r0 + std::min(nrows - 1, t0 + 16 * u + 15)) update(t0 + 16 * u, Sb + u * 16 * PF_KB);
        };
        // One tile behind: the next tile's score products run on the tiles while this one's
        // softmax runs on the vector units.
        int prev = -1;
        for (int t0 = 0; t0 < nrows; t0 += 32) {
            if (k0 > p0 + r0 + std::min(nrows - 1, t0 + 31)) continue;  // no row of the tile sees this block yet
            scores(t0, S + ((t0 / 32) & 1) * 32 * PF_KB);
            if (prev >= 0) update32(prev, S + ((prev / 32) & 1) * 32 * PF_KB);
            prev = t0;
        }
        if (prev >= 0) update32(prev, S + ((prev / 32) & 1) * 32 * PF_KB);
    }
    for (int i = 0; i < nrows; ++i) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * i)));
        uint16_t* dst = out + static_cast<int64_t>(r0 + i) * out_stride + static_cast<int64_t>(h) * hd;
        for (int e = 0; e < hd; e += 16) narrow16(dst + e, _mm512_mul_ps(_mm512_loadu_ps(O + static_cast<int64_t>(i) * hd + e), inv));
    }
}

// The softmax step of one 32-key block (k0 .. k0 + 31) for rows 0 .. nrows - 1 (at positions
// pos0 + i) of the AMX prefill kernels: s [16 x 32] f32 scores in, pb [16 x 32] bf16 P out (2^(s
// * sl - m)), l [16 x 16] the rows' running sums; a row whose block max passes its lazy margin
// (mlazy) takes the exact max, and its O and l the factor corr[i] (0 on the first block, where
// they are 0). Returns the mask of those rows. prefill_task's softmax (softmax_block_row) on 2
// vectors of scores a row.
inline unsigned softmax_block32(const float* s, uint16_t* pb, float* l, float* m, float* mlazy, float* corr, int nrows, int pos0, int k0,
                                bool first, __m512 sl) {
    constexpr int KB = 32;
    const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // bf16 1.0
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    unsigned moved = 0;
    for (int i = 0; i < nrows; ++i) {
        const int pos = pos0 + i;
        __m512 s0 = _mm512_mul_round_ps(_mm512_load_ps(s + i * KB), sl, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 s1 = _mm512_mul_round_ps(_mm512_load_ps(s + i * KB + 16), sl, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (k0 + KB - 1 > pos) {  // the diagonal block: hide keys past the query
            const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(k0));
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            s0 = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos)), ninf, s0);
            s1 = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(_mm512_add_epi32(key, _mm512_set1_epi32(16)), _mm512_set1_epi32(pos)), ninf, s1);
        }
        const __m512 mx = _mm512_max_ps(s0, s1);
        // past the lazy margin (mlazy = m + PF_LAZY): the exact max, which is then above m
        if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(mlazy[i]), _CMP_GT_OQ)) {
            const float mo = m[i], mn = _mm512_reduce_max_ps(mx);
            corr[i] = first ? 0.f : std::exp2(mo - mn);
            _mm512_store_ps(l + 16 * i, _mm512_mul_ps(_mm512_load_ps(l + 16 * i), _mm512_set1_ps(corr[i])));
            m[i] = mn;
            mlazy[i] = mn + PF_LAZY;
            moved |= 1u << i;
        }
        const __m512 mv = _mm512_set1_ps(m[i]);
        const __m512i p01 = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(exp2_bf16(_mm512_sub_ps(s1, mv)), exp2_bf16(_mm512_sub_ps(s0, mv))));
        _mm512_store_si512(pb + i * KB, p01);
        // l sums the bf16 P, two at a time in one dot product against ones
        _mm512_store_ps(l + 16 * i, _mm512_dpbf16_ps(_mm512_load_ps(l + 16 * i), reinterpret_cast<__m512bh>(p01), ones));
    }
    return moved;
}

// The pieces prefill_rows_amx64 and prefill_rows_amx128 share. Tiles: 0-1 S (keys 0-15,
// 16-31 of a 32-key block), 2-5 a 64-column half of O (16 columns each), 6 A, 7 B.

// Q rows r0 .. r0 + nrows - 1 of head h (HD wide) into Qb's 16 rows, zero past nrows; the rows'
// max m and its lazy margin to -inf, their sums l to 0.
template <int HD>
inline void amx_rows_start(const uint16_t* q, int64_t q_stride, int h, int r0, int nrows, uint16_t* Qb, float* m, float* mlazy, float* l) {
    for (int i = 0; i < 16; ++i) {
        m[i] = mlazy[i] = -INFINITY;
        uint16_t* dst = Qb + i * HD;
        if (i < nrows)
            std::memcpy(dst, q + (r0 + i) * q_stride + static_cast<int64_t>(h) * HD, sizeof(uint16_t) * HD);
        else
            std::memset(dst, 0, sizeof(uint16_t) * HD);
    }
    std::memset(l, 0, sizeof(float) * 16 * 16);
}

// Block j's scores from tiles 0-1 into its half of S (2 x 16 x 32 f32).
inline void amx_store_scores(float* S, int j) {
    float* s = S + (j & 1) * 16 * 32;
    _tile_stored(0, s, 32 * 4);
    _tile_stored(1, s + 16, 32 * 4);
}

// O's half between tiles 2-5 and Ob (16 x 64 f32).
inline void amx_o_tiles(float* Ob, bool store) {
    if (store) {
        _tile_stored(2, Ob, 64 * 4);
        _tile_stored(3, Ob + 16, 64 * 4);
        _tile_stored(4, Ob + 32, 64 * 4);
        _tile_stored(5, Ob + 48, 64 * 4);
    } else {
        _tile_loadd(2, Ob, 64 * 4);
        _tile_loadd(3, Ob + 16, 64 * 4);
        _tile_loadd(4, Ob + 32, 64 * 4);
        _tile_loadd(5, Ob + 48, 64 * 4);
    }
}

// O's half (tiles 2-5) += P (pb: 16 x 32 bf16) . V's 64 columns at vb (the block's 16 key pairs,
// rows v_row bytes apart).
inline void amx_pv(const uint16_t* pb, const uint16_t* vb, int v_row) {
    _tile_loadd(6, pb, 32 * 2);
    _tile_loadd(7, vb, v_row);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(7, vb + 32, v_row);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(7, vb + 64, v_row);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, vb + 96, v_row);
    _tile_dpbf16ps(5, 6, 7);
}

// O's half in the tiles, each row times its factor corr[i] where bit i of rows is set.
inline void amx_rescale(float* Ob, unsigned rows, const float* corr, int nrows) {
    amx_o_tiles(Ob, true);
    for (int i = 0; i < nrows; ++i)
        if (rows >> i & 1)
            for (int e = 0; e < 64; e += 16) _mm512_store_ps(Ob + i * 64 + e, _mm512_mul_ps(_mm512_load_ps(Ob + i * 64 + e), _mm512_set1_ps(corr[i])));
    amx_o_tiles(Ob, false);
}

// The key-block loop of both AMX prefill kernels, O's half in tiles 2-5 from zero: block j + 1's
// score products (scores(j + 1), into tiles 0-1) go to the tiles before block j's softmax and
// P . V (block(j, its scores in S)) run, and are stored to S only after them (stored right behind
// their products they held the softmax up).
template <typename Scores, typename Block>
inline void amx_key_blocks(int nb, float* S, Scores&& scores, Block&& block) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    scores(0);
    amx_store_scores(S, 0);
    for (int j = 0; j < nb; ++j) {
        if (j + 1 < nb) scores(j + 1);
        block(j, S + (j & 1) * 16 * 32);
        if (j + 1 < nb) amx_store_scores(S, j + 1);
    }
}

// O's half from the tiles, divided by the rows' sums, into dst's rows (out_stride apart).
inline void amx_emit(float* Ob, const float* l, int nrows, uint16_t* dst, int64_t out_stride) {
    amx_o_tiles(Ob, true);
    for (int i = 0; i < nrows; ++i) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(l + 16 * i)));
        for (int e = 0; e < 64; e += 16) narrow16(dst + i * out_stride + e, _mm512_mul_ps(_mm512_load_ps(Ob + i * 64 + e), inv));
    }
}

// Rows [r0, r1) (at most 16) of query head h for head_dim 64 on AMX tiles, with the output O
// held in four accumulator tiles across all the key blocks (32 keys each): only K and V stream
// in, while Q (2 KB), S (2 x 2 KB) and P (2 x 1 KB) stay in L1 (prefill_task_amx's ~85 KB of
// Q, O and S for 96 rows did not fit it). The next block's scores go to the tiles before this
// block's softmax (prefill_task's, on 32 keys) runs on the vector units. O is stored and
// rescaled only when a row's max moves past its lazy margin.
// Qb: 16 x 64 bf16; S: 2 x 16 x 32 f32; Pb: 2 x 16 x 32 bf16; Ob: 16 x 64 f32; m: 16; l: 16 x 16.
// S, Pb, Ob and l 64-byte aligned.
void prefill_rows_amx64(const uint16_t* q, int64_t q_stride, const uint16_t* Kp, const uint16_t* Vp, int h, int r0, int r1, int p0,
                        float scale, uint16_t* out, int64_t out_stride, float* Ob, float* m, float* l, uint16_t* Qb, float* S,
                        uint16_t* Pb) {
    constexpr int hd = 64, KB = 32;
    const int nrows = r1 - r0;
    alignas(64) float mlazy[16];
    amx_rows_start<hd>(q, q_stride, h, r0, nrows, Qb, m, mlazy, l);
    std::memset(Pb, 0, sizeof(uint16_t) * 2 * 16 * KB);  // rows past nrows stay 0
    const int nb = (p0 + r1 - 1) / KB + 1;  // key blocks up to the last row's position
    const __m512 sl = _mm512_set1_ps(scale * 1.44269504088896341f);
    auto scores = [&](int j) {  // S = Q . K^T for block j into tiles 0-1
        const uint16_t* kb = Kp + static_cast<int64_t>(j) * KB * hd;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, Qb, hd * 2);
        _tile_loadd(7, kb, 64);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, kb + 16 * hd, 64);
        _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(6, Qb + 32, hd * 2);
        _tile_loadd(7, kb + 512, 64);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, kb + 16 * hd + 512, 64);
        _tile_dpbf16ps(1, 6, 7);
    };
    amx_key_blocks(nb, S, scores, [&](int j, const float* sj) {
        const int k0 = j * KB;
        uint16_t* pb = Pb + (j & 1) * 16 * KB;
        alignas(64) float corr[16];
        const unsigned moved = softmax_block32(sj, pb, l, m, mlazy, corr, nrows, p0 + r0, k0, j == 0, sl);
        if (moved && j > 0) amx_rescale(Ob, moved, corr, nrows);
        // O += P . V: the block's 16 key pairs, 16 output columns a tile
        amx_pv(pb, Vp + static_cast<int64_t>(k0) * hd, hd * 4);
    });
    amx_emit(Ob, l, nrows, out + static_cast<int64_t>(r0) * out_stride + static_cast<int64_t>(h) * hd, out_stride);
}

// Rows [r0, r1) (at most 16) of query head h for head_dim 128 on AMX tiles: prefill_rows_amx64's
// scheme in two passes over the keys, since four accumulator tiles hold 64 of O's 128 columns.
// The first computes the scores, the softmax (each block's P kept in Pall, with the blocks at
// which rows' max moved and their factors) and O's columns 0-63; the second O's columns 64-127
// from the kept P, rescaled at the same blocks by the same factors. Each block's scores and
// softmax are computed once (an earlier try computed them again for the second half of O and
// lost to the 96-row kernel; docs/SPEED.md, "Qwen3's shapes").
// Qb: 16 x 128 bf16; S: 2 x 16 x 32 f32; Ob: 16 x 64 f32; m: 16; l: 16 x 16; for nb key blocks:
// Pall: nb x 16 x 32 bf16, corr: nb x 16 f32, moved: nb. S, Ob, l and Pall 64-byte aligned.
void prefill_rows_amx128(const uint16_t* q, int64_t q_stride, const uint16_t* Kp, const uint16_t* Vp, int h, int r0, int r1, int p0,
                         float scale, uint16_t* out, int64_t out_stride, float* Ob, float* m, float* l, uint16_t* Qb, float* S,
                         uint16_t* Pall, float* corr, unsigned* moved) {
    constexpr int hd = 128, KB = 32, half = 64;
    const int nrows = r1 - r0;
    alignas(64) float mlazy[16];
    amx_rows_start<hd>(q, q_stride, h, r0, nrows, Qb, m, mlazy, l);
    const int nb = (p0 + r1 - 1) / KB + 1;  // key blocks up to the last row's position
    if (nrows < 16) std::memset(Pall, 0, sizeof(uint16_t) * nb * 16 * KB);  // rows past nrows stay 0
    const __m512 sl = _mm512_set1_ps(scale * 1.44269504088896341f);
    auto scores = [&](int j) {  // S = Q . K^T for block j into tiles 0-1, head_dim 32 a product
        const uint16_t* kb = Kp + static_cast<int64_t>(j) * KB * hd;
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < hd / 32; ++c) {
            _tile_loadd(6, Qb + 32 * c, hd * 2);
            _tile_loadd(7, kb + 512 * c, 64);
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, kb + 16 * hd + 512 * c, 64);
            _tile_dpbf16ps(1, 6, 7);
        }
    };
    // block j's P . V for the half of O from column c0
    auto pv = [&](int j, int c0) { amx_pv(Pall + static_cast<int64_t>(j) * 16 * KB, Vp + static_cast<int64_t>(j) * KB * hd + 2 * c0, hd * 4); };
    uint16_t* dst = out + static_cast<int64_t>(r0) * out_stride + static_cast<int64_t>(h) * hd;
    amx_key_blocks(nb, S, scores, [&](int j, const float* sj) {
        moved[j] = softmax_block32(sj, Pall + static_cast<int64_t>(j) * 16 * KB, l, m, mlazy, corr + j * 16, nrows, p0 + r0, j * KB, j == 0, sl);
        if (moved[j] && j > 0) amx_rescale(Ob, moved[j], corr + j * 16, nrows);
        pv(j, 0);
    });
    amx_emit(Ob, l, nrows, dst, out_stride);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int j = 0; j < nb; ++j) {
        if (moved[j] && j > 0) amx_rescale(Ob, moved[j], corr + j * 16, nrows);
        pv(j, half);
    }
    amx_emit(Ob, l, nrows, dst + half, out_stride);
}

// One configuration for the attention tiles: all eight 16 rows x 64 bytes.
void amx_configure_square() {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
#endif

// --- bf16 GEMM on bf16 dot products (vdpbf16ps) over a weight in pair panels -----------------
// W [N, K] laid out per 64 output columns and per pair of K: 4 vectors of 16 columns x 2 K
// values (the pair layout vdpbf16ps takes), so the weight streams once per call in its 2-byte
// form and every x row pair broadcasts against it. Tiles of up to 6 rows x 64 columns (24 f32
// accumulators); a task is one panel for every row, so the panel (K x 128 bytes) stays in L2.

// bias[col .. col + 15] widened (the lanes of mk; 0 without a bias): the GEMM epilogues' bias.
inline __m512 bias_cols(const uint16_t* bias, int col, __mmask16 mk) {
    if (!bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias + col)), 16));
}

// Columns col .. col + 15 (those below N) of y's rows m0 .. m0 + rows - 1: acc(r) + bias, rounded
// once to bf16 and stored as bf16, or with F32 as the f32 value of that bf16. The epilogue of
// the pair GEMM and of its AMX form.
template <bool F32, typename Acc>
inline void store_cols(void* y, int64_t ldy, const uint16_t* bias, int N, int col, int m0, int rows, Acc&& acc) {
    const int valid = N - col < 16 ? N - col : 16;
    const __mmask16 mk = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias_cols(bias, col, mk);
    for (int r = 0; r < rows; ++r) {
        const __m512 v = round_bf16(_mm512_add_ps(acc(r), b));
        const int64_t at = static_cast<int64_t>(m0 + r) * ldy + col;
        if constexpr (F32)
            _mm512_mask_storeu_ps(static_cast<float*>(y) + at, mk, v);
        else
            _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + at, mk, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    }
}

// SwiGLU of 16 gate columns from col (of I gate columns) and their up columns, in the GLU_BLOCK
// layout (the bias's gate columns from 2 col, its up columns 16 on): the values store_cols
// would store for both (bias added, rounded to bf16), then silu_mul_bf16's arithmetic on them
// (swiglu16), so the same bits as the GEMM's bf16 output followed by silu_mul_bf16.
template <typename G, typename U>
inline void glu_store(uint16_t* out, int I, const uint16_t* bias, int col, int m0, int rows, G&& gate, U&& up) {
    const __m512 bg = bias_cols(bias, 2 * col, 0xffff), bu = bias_cols(bias, 2 * col + 16, 0xffff);
    for (int r = 0; r < rows; ++r) {
        const __m512 gv = round_bf16(_mm512_add_ps(gate(r), bg));
        const __m512 uv = round_bf16(_mm512_add_ps(up(r), bu));
        narrow16(out + static_cast<int64_t>(m0 + r) * I + col, swiglu16(gv, uv));
    }
}

// A thread's running argmax of each row over the columns it has seen, per lane: 16 values
// and their columns a row ([M][16] each). Columns reach a lane in increasing order, so a
// strict > keeps the first of equal values; a NaN beats any number, the first NaN stays.
struct ArgRows {
    float* best;
    int32_t* idx;
};

// The values store_cols would store (bf16-rounded, bias added), folded into st instead.
template <typename Acc>
inline void argmax_cols(const ArgRows& st, const uint16_t* bias, int N, int col, int m0, int rows, Acc&& acc) {
    const int valid = N - col < 16 ? N - col : 16;
    const __mmask16 mk = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias_cols(bias, col, mk);
    const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(col), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    for (int r = 0; r < rows; ++r) {
        const __m512 v = round_bf16(_mm512_add_ps(acc(r), b));
        float* bp = st.best + static_cast<int64_t>(m0 + r) * 16;
        int32_t* ip = st.idx + static_cast<int64_t>(m0 + r) * 16;
        const __m512 bv = _mm512_loadu_ps(bp);
        const __mmask16 take = mk & (_mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ) |
                                     (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(bv, bv, _CMP_ORD_Q)));
        _mm512_storeu_ps(bp, _mm512_mask_blend_ps(take, bv, v));
        _mm512_storeu_si512(ip, _mm512_mask_blend_epi32(take, _mm512_loadu_si512(ip), cols));
    }
}

// A pair tile's accumulators [R rows][4 x 16 columns] out as F32 / GLU / ARG say (pair_tile's).
template <int R, bool F32, bool GLU, bool ARG>
inline void pair_tile_out(const __m512 (&acc)[R][4], const uint16_t* bias, void* y, int64_t ldy, int N, int n0, int m0) {
    if constexpr (ARG) {
        for (int c = 0; c < 4 && n0 + 16 * c < N; ++c)
            argmax_cols(*static_cast<const ArgRows*>(y), bias, N, n0 + 16 * c, m0, R, [&](int r) { return acc[r][c]; });
    } else if constexpr (GLU) {
        for (int c = 0; c < 4; c += 2)
            glu_store(static_cast<uint16_t*>(y), static_cast<int>(ldy), bias, n0 / 2 + 8 * c, m0, R, [&](int r) { return acc[r][c]; },
                      [&](int r) { return acc[r][c + 1]; });
    } else {
        for (int c = 0; c < 4 && n0 + 16 * c < N; ++c)
            store_cols<F32>(y, ldy, bias, N, n0 + 16 * c, m0, R, [&](int r) { return acc[r][c]; });
    }
}

// Q > 0: also prefetches Q lines a k pair from pf on, K2 Q lines in all (its share of the next
// panel, see gemm_pairs).
// F32: y is f32 and gets the bf16-rounded values widened (what .float() of the bf16 result
// gives), for the LM head, whose logits the sampler takes in f32.
// GLU: P packs a gate and up weight in GLU_BLOCK's layout (N a multiple of 64: the panel's
// column groups are gate, up, gate, up), y [M, N / 2] (ldy N / 2) gets their SwiGLU (glu_store).
// ARG: y is the thread's ArgRows, and the values F32 would store are folded into it.
template <int R, int Q = 0, bool F32 = false, bool GLU = false, bool ARG = false>
void pair_tile(const uint16_t* P, const uint16_t* x, int64_t ldx, const uint16_t* bias, void* y, int64_t ldy, int N, int K2, int n0,
               int m0, const char* pf = nullptr) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint16_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + static_cast<int64_t>(m0 + r) * ldx;
    for (int j = 0; j < K2; ++j) {
        if constexpr (Q > 0) {
            for (int u = 0; u < Q; ++u) __builtin_prefetch(pf + 64 * u, 0, 3);
            pf += 64 * Q;
        }
        __m512bh w[4];
        for (int c = 0; c < 4; ++c) w[c] = load_bh(P + (static_cast<int64_t>(j) * 4 + c) * 32);
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = pair_bcast(xr[r] + 2 * j);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, w[c]);
        }
    }
    pair_tile_out<R, F32, GLU, ARG>(acc, bias, y, ldy, N, n0, m0);
}

#if defined(__AVX512BW__)
// The 4 bf16 vectors of k pair j of a Pairs12 panel (load_bh's, the same bits): low bytes widened
// to words, each code's high byte from the table (vpermw reads 5 index bits: T holds its 16
// entries twice, so a code byte's other nibble in bit 4 does not matter), and the panel's
// exceptions at j written over them (ei: its next one; nj: that one's k pair).
struct P12Reader {
    const uint8_t* blk;
    const uint32_t* eo;
    const uint16_t* ev;
    int ei, ee;
    int64_t first;  // the panel's first k pair, as exc_off counts them
    int64_t nj;
    __m512i T;
    P12Reader(const Pairs12& w, int p, int K2, __m512i table)
        : blk(w.blocks + static_cast<int64_t>(p) * K2 * P12_BLOCK), eo(w.exc_off), ev(w.exc_val), ei(w.exc_start[p]),
          ee(w.exc_start[p + 1]), first(static_cast<int64_t>(p) * K2), T(table) {
        next();
    }
    void next() { nj = ei < ee ? (static_cast<int64_t>(eo[ei]) >> 7) - first : INT64_MAX; }
    inline void load(int j, __m512bh (&w)[4]) {
        const uint8_t* b = blk + static_cast<int64_t>(j) * P12_BLOCK;
        const __m512i e01 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128)));
        const __m512i e23 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 160)));
        __m512i v[4];
        v[0] = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))), _mm512_permutexvar_epi16(e01, T));
        v[1] = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32))),
                               _mm512_permutexvar_epi16(_mm512_srli_epi16(e01, 4), T));
        v[2] = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64))), _mm512_permutexvar_epi16(e23, T));
        v[3] = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 96))),
                               _mm512_permutexvar_epi16(_mm512_srli_epi16(e23, 4), T));
        if (__builtin_expect(j == nj, 0)) {
            alignas(64) uint16_t buf[128];
            for (int c = 0; c < 4; ++c) _mm512_store_si512(buf + 32 * c, v[c]);
            for (; ei < ee && (static_cast<int64_t>(eo[ei]) >> 7) - first == j; ++ei) buf[eo[ei] & 127] = ev[ei];
            next();
            for (int c = 0; c < 4; ++c) v[c] = _mm512_load_si512(buf + 32 * c);
        }
        for (int c = 0; c < 4; ++c) w[c] = reinterpret_cast<__m512bh>(v[c]);
    }
};

// The table P12Reader widens a code with: sign << 15 | (base + low 3 bits) << 8, twice over.
inline __m512i p12_table(int base) {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) t[i] = static_cast<uint16_t>((((i >> 3) & 1) << 15) | ((base + (i & 7)) << 8));
    return _mm512_load_si512(t);
}

// pair_tile (without a prefetch) on panel p of a Pairs12 weight.
template <int R, bool F32, bool GLU>
void pair12_tile(const Pairs12& wt, int p, __m512i T, const uint16_t* x, int64_t ldx, const uint16_t* bias, void* y, int64_t ldy,
                 int N, int K2) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    P12Reader rd(wt, p, K2, T);
    for (int j = 0; j < K2; ++j) {
        __m512bh w[4];
        rd.load(j, w);
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = pair_bcast(x + static_cast<int64_t>(r) * ldx + 2 * j);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, w[c]);
        }
    }
    pair_tile_out<R, F32, GLU, false>(acc, bias, y, ldy, N, p * GP_COLS, 0);
}

// gemm_pairs_impl<F32, GLU> for 1 to PAIRS12_MAX_ROWS rows on a Pairs12 weight (K even): the
// same bits.
template <bool F32, bool GLU>
int gemm_pairs12_impl(const Pairs12* w, const uint16_t* x, void* y, const uint16_t* bias, int M, int N, int K) {
    if (M < 1 || M > PAIRS12_MAX_ROWS || K % 2) return -1;
    const int K2 = K / 2, panels = (N + GP_COLS - 1) / GP_COLS;
    const int64_t ldy = GLU ? N / 2 : N;
    const __m512i T = p12_table(w->base);
#pragma omp parallel
    {
        const auto [p_begin, p_end] = thread_share(panels);
        for (int p = p_begin; p < p_end; ++p) {
            switch (M) {
                case 1: pair12_tile<1, F32, GLU>(*w, p, T, x, K, bias, y, ldy, N, K2); break;
                case 2: pair12_tile<2, F32, GLU>(*w, p, T, x, K, bias, y, ldy, N, K2); break;
                case 3: pair12_tile<3, F32, GLU>(*w, p, T, x, K, bias, y, ldy, N, K2); break;
                default: pair12_tile<4, F32, GLU>(*w, p, T, x, K, bias, y, ldy, N, K2); break;
            }
        }
    }
    return 0;
}
#endif
#endif

}  // namespace

extern "C" {

int iterserve_kernels_version() { return 1; }
// Lays out W [N, K] (bf16, row-major) as panels (see PANEL): P holds ceil(N / 32) * K * 32
// bf16, columns past N zero.
void pack_bf16_panels(const uint16_t* W, uint16_t* P, int N, int K) {
    const int panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        uint16_t* dst = P + static_cast<int64_t>(p) * K * PANEL;
        for (int j = 0; j < PANEL; ++j) {
            const int n = p * PANEL + j;
            const int lane = 2 * (j % 16) + j / 16;  // low half: columns 0-15, high half: 16-31
            for (int k = 0; k < K; ++k) dst[static_cast<int64_t>(k) * PANEL + lane] = n < N ? W[static_cast<int64_t>(n) * K + k] : 0;
        }
    }
}

// y[M, N] = x[M, K] . W^T + bias with W packed by pack_bf16_panels; x, y, bias bf16 (x_f32 = 0)
// or f32 (x_f32 = 1); bias may be null. A task is one panel: its lines stay in L2 while all
// rows of x pass, 14 at a time (28 accumulators: 28 FMAs per line against the 2 ops that widen it;
// 14 against 8 rows: 0.91x the time of all bench-134m GEMMs at 32 rows, 0.80x at 14, 0.94x at
// 128), then 8, 4, 2, 1.
void gemm_panels(const uint16_t* P, const void* x, void* y, const void* bias, int x_f32, int M, int N, int K) {
    std::vector<float> xf(static_cast<size_t>(M) * K);
    std::vector<float> bf(bias ? N : 0);
    const float* b = bias ? bf.data() : nullptr;
    const int panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel
    {
        // widen x (and the bias) on every thread: single-threaded it cost ~0.7 ms a 32-row step
#pragma omp for schedule(static)
        for (int i = 0; i < M; ++i) load_row(x, x_f32, static_cast<int64_t>(i) * K, K, xf.data() + static_cast<size_t>(i) * K);
        if (bias) {
#pragma omp single
            load_row(bias, x_f32, 0, N, bf.data());
        }
#if defined(ITERSERVE_AVX2)
        std::vector<float> scratch;
        float* wf = nullptr;
        float* cbuf = nullptr;
        if (M >= F32_TILE_MIN_ROWS) {
            scratch.resize(static_cast<size_t>(KC + M) * PANEL + 8);
            wf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t(31));
            cbuf = wf + KC * PANEL;
        }
#endif
#pragma omp for schedule(static)
        for (int p = 0; p < panels; ++p) {
            const uint16_t* Pp = P + static_cast<int64_t>(p) * K * PANEL;
            const int n0 = p * PANEL;
            int m0 = 0;
#if defined(ITERSERVE_AVX2)
            if (M >= F32_TILE_MIN_ROWS) {
                panel_task_f32(Pp, xf.data(), b, y, x_f32, N, K, n0, M, wf, cbuf);
                continue;
            }
            // 6 rows: 12 accumulators, a weight pair and a broadcast fill the 16 registers; 8 left
            // go as 4 + 4 (4-row tiles run at the 6-row speed, the 2-row one at ~0.65x)
            for (; M - m0 >= 6 && M - m0 != 8; m0 += 6) panel_rows<6, 1>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            for (; M - m0 >= 4; m0 += 4) panel_rows<4, 1>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            if (M - m0 == 3) panel_rows_full<3, 1>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            if (M - m0 == 2) panel_rows_full<2, 1>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            if (M - m0 == 1) panel_rows_full<1, 2>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
#else
            for (; M - m0 >= 14; m0 += 14) panel_rows<14, 1>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            for (; M - m0 >= 8; m0 += 8) panel_rows<8, 1>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            for (; M - m0 >= 4; m0 += 4) panel_rows<4, 2>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            for (; M - m0 >= 2; m0 += 2) panel_rows<2, 4>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
            for (; M - m0 >= 1; m0 += 1) panel_rows<1, 8>(Pp, xf.data(), b, y, x_f32, N, K, n0, m0);
#endif
        }
    }
}

// The sum of squares of a bf16 row in f32, in the order rms_norm_bf16 adds them (torch adds in
// another order, which moves the last place of the sum and so, rarely, a bf16 output: about one
// element in 10^5 on wide-ranged inputs).
inline float sumsq_bf16(const uint16_t* x, int n) {
    int i0 = 0;
    float ss = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i0 + 16 <= n; i0 += 16) {
        const __m512 v = widen16(x + i0);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#elif defined(ITERSERVE_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i0 + 16 <= n; i0 += 16) {
        const __m256 v0 = widen8(x + i0), v1 = widen8(x + i0 + 8);
        acc0 = _mm256_fmadd_ps(v0, v0, acc0);
        acc1 = _mm256_fmadd_ps(v1, v1, acc1);
    }
    ss = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (int i = i0; i < n; ++i) ss += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    return ss;
}

// o = bf16(bf16(x * inv) * w) over a row of n: the norm's last step.
inline void scale_row_bf16(const uint16_t* x, float inv, const uint16_t* w, uint16_t* o, int n) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) narrow16(o + i, _mm512_mul_ps(round_bf16(_mm512_mul_ps(widen16(x + i), iv)), widen16(w + i)));
#elif defined(ITERSERVE_AVX2)
    const __m256 iv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8) narrow8(o + i, _mm256_mul_ps(round_bf16_8(_mm256_mul_ps(widen8(x + i), iv)), widen8(w + i)));
#endif
    for (; i < n; ++i) o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * inv)) * bf16_to_f32(w[i]));
}

// Llama's RMSNorm on bf16 rows, rounded as transformers rounds it: y = bf16(x * rsqrt(mean(x^2)
// + eps)), out = bf16(y * w), with f32 arithmetic in between (as torch's bf16 ops). With `add`,
// first x = bf16(x + add) in place (the residual add before the norm).
void rms_norm_bf16(uint16_t* x, const uint16_t* add, const uint16_t* w, uint16_t* out, int rows, int n, float eps) {
#pragma omp parallel for schedule(static) if (int64_t(rows) * n >= PAR_MIN_ELEMS)
    for (int r = 0; r < rows; ++r) {
        uint16_t* xr = x + static_cast<int64_t>(r) * n;
        const uint16_t* ar = add ? add + static_cast<int64_t>(r) * n : nullptr;
        float ss = 0.f;
        if (!ar) {
            ss = sumsq_bf16(xr, n);
        } else {  // the add in the same pass, the squares in sumsq_bf16's order
            int i0 = 0;
#if defined(__AVX512F__)
            __m512 acc = _mm512_setzero_ps();
            for (; i0 + 16 <= n; i0 += 16) {
                const __m512 v = round_bf16(_mm512_add_ps(widen16(xr + i0), widen16(ar + i0)));
                narrow16(xr + i0, v);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            ss = _mm512_reduce_add_ps(acc);
#elif defined(ITERSERVE_AVX2)
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            for (; i0 + 16 <= n; i0 += 16) {
                const __m256 v0 = round_bf16_8(_mm256_add_ps(widen8(xr + i0), widen8(ar + i0)));
                const __m256 v1 = round_bf16_8(_mm256_add_ps(widen8(xr + i0 + 8), widen8(ar + i0 + 8)));
                narrow8(xr + i0, v0);
                narrow8(xr + i0 + 8, v1);
                acc0 = _mm256_fmadd_ps(v0, v0, acc0);
                acc1 = _mm256_fmadd_ps(v1, v1, acc1);
            }
            ss = hsum8(_mm256_add_ps(acc0, acc1));
#endif
            for (int i = i0; i < n; ++i) {
                xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(ar[i]));
                ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
            }
        }
        scale_row_bf16(xr, 1.f / std::sqrt(ss / static_cast<float>(n) + eps), w, out + static_cast<int64_t>(r) * n, n);
    }
}

// The gate and up weights' rows alternate in blocks of this many where the pair GEMM (dot
// products or AMX) runs SwiGLU in its epilogue (gemm_pairs_swiglu, gemm_amx_swiglu;
// layers.GLU_BLOCK says the same).
constexpr int GLU_BLOCK = 16;

// SwiGLU on bf16 rows of width 2 * n that hold gate and up: out = bf16(bf16(silu(gate)) * up).
// block 0: [gate | up]; block > 0 (n a multiple of it): gate and up alternate in blocks of
// `block` columns, gate first (GLU_BLOCK: the product of the SwiGLU epilogues' weight).
void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int rows, int n, int block) {
    // a block that does not divide n would run past the rows: [gate | up] then (the wrapper
    // rejects it; this keeps a bad call inside its buffers)
    const int width = block > 0 && n % block == 0 ? block : n;  // a gate span's columns, its up span next
    auto span = [](const uint16_t* g, const uint16_t* u, uint16_t* o, int w) {
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= w; i += 16) narrow16(o + i, swiglu16(widen16(g + i), widen16(u + i)));
#elif defined(ITERSERVE_AVX2)
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= w; i += 8) {
            const __m256 gv = widen8(g + i);
            const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            narrow8(o + i, _mm256_mul_ps(round_bf16_8(sv), widen8(u + i)));
        }
#endif
        for (; i < w; ++i) {
            const float gv = bf16_to_f32(g[i]);
            const float sv = bf16_to_f32(f32_to_bf16(gv / (1.f + std::exp(-gv))));
            o[i] = f32_to_bf16(sv * bf16_to_f32(u[i]));
        }
    };
#pragma omp parallel for schedule(static) if (int64_t(rows) * 2 * n >= PAR_MIN_ELEMS)
    for (int r = 0; r < rows; ++r) {
        const uint16_t* row = gu + static_cast<int64_t>(r) * 2 * n;
        uint16_t* o = out + static_cast<int64_t>(r) * n;
#if defined(__AVX512F__)
        if (width == 16) {
            // GLU_BLOCK: one vector a span, two spans a step (two independent exp chains, as the
            // compiler interleaves span's own loop; one span a step took 1.25x as long)
            int c = 0;
            for (; c + 32 <= n; c += 32) {
                const __m512 a = swiglu16(widen16(row + 2 * c), widen16(row + 2 * c + 16));
                const __m512 b = swiglu16(widen16(row + 2 * c + 32), widen16(row + 2 * c + 48));
                narrow16(o + c, a);
                narrow16(o + c + 16, b);
            }
            if (c < n) narrow16(o + c, swiglu16(widen16(row + 2 * c), widen16(row + 2 * c + 16)));
            continue;
        }
#endif
        for (int c = 0; c < n; c += width) span(row + 2 * c, row + 2 * c + width, o + c, width);
    }
}

#if defined(__AVX512F__)
// rope_bf16 for one token at head_dim 16 * NV: its cos and sin widened once for all its heads,
// each head's x widened once for both of its uses (as itself and rotated); with `nw`, each head
// first takes its RMSNorm (weight row nw + h * hd), as sumsq_bf16 and scale_row_bf16 compute it.
extern "C++" template <int NV>
void rope_token16(const uint16_t* xt, const uint16_t* c, const uint16_t* sn, uint16_t* ot, int n, const uint16_t* nw, float eps) {
    constexpr int hd = 16 * NV, HV = NV / 2;  // HV: vectors in half a head
    __m512 cv[NV], sv[NV];
    for (int k = 0; k < NV; ++k) {
        cv[k] = widen16(c + 16 * k);
        sv[k] = widen16(sn + 16 * k);
    }
    for (int h = 0; h < n; ++h) {
        const uint16_t* xh = xt + h * hd;
        uint16_t* o = ot + h * hd;
        __m512 xv[NV];
        for (int k = 0; k < NV; ++k) xv[k] = widen16(xh + 16 * k);
        if (nw) {
            __m512 acc = _mm512_setzero_ps();
            for (int k = 0; k < NV; ++k) acc = _mm512_fmadd_ps(xv[k], xv[k], acc);
            const __m512 iv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(hd) + eps));
            const uint16_t* wh = nw + h * hd;
            for (int k = 0; k < NV; ++k) xv[k] = round_bf16(_mm512_mul_ps(round_bf16(_mm512_mul_ps(xv[k], iv)), widen16(wh + 16 * k)));
        }
        for (int k = 0; k < NV; ++k) {
            const __m512 a = round_bf16(_mm512_mul_ps(xv[k], cv[k]));
            const __m512 b = round_bf16(_mm512_mul_ps(xv[k < HV ? k + HV : k - HV], sv[k]));
            narrow16(o + 16 * k, _mm512_add_ps(a, b));
        }
    }
}
#endif

// Rotary embedding on bf16 [T, n, hd] (rows of x row_stride apart, heads contiguous) with
// per-token cos / sin_signed [T, hd] (sin_signed = -sin on the first half): out = bf16(bf16(x *
// cos) + bf16(x_rotated_half * sin_signed)), the roundings of the three torch ops it replaces.
// norm_w (or null) [n, hd]: each head's RMSNorm first (Qwen3's q / k norm: rms_norm_bf16's
// arithmetic on a row of hd, the same bits as it, weight row h for head h).
void rope_bf16(const uint16_t* x, int64_t row_stride, const uint16_t* cos, const uint16_t* sin, uint16_t* out, int T, int n, int hd,
               const uint16_t* norm_w, float eps) {
    const int half = hd / 2;
#if defined(__AVX512F__)
    if (hd == 64 || hd == 128) {
#pragma omp parallel for schedule(static) if (int64_t(T) * n * hd >= PAR_MIN_ELEMS)
        for (int t = 0; t < T; ++t) {
            const uint16_t* xt = x + static_cast<int64_t>(t) * row_stride;
            uint16_t* ot = out + static_cast<int64_t>(t) * n * hd;
            const uint16_t *c = cos + static_cast<int64_t>(t) * hd, *sn = sin + static_cast<int64_t>(t) * hd;
            if (hd == 64)
                rope_token16<4>(xt, c, sn, ot, n, norm_w, eps);
            else
                rope_token16<8>(xt, c, sn, ot, n, norm_w, eps);
        }
        return;
    }
#endif
#pragma omp parallel if (int64_t(T) * n * hd >= PAR_MIN_ELEMS)
    {
        std::vector<uint16_t> normed(norm_w ? hd : 0);  // a head after its norm
#pragma omp for schedule(static)
        for (int t = 0; t < T; ++t) {
            const uint16_t* c = cos + static_cast<int64_t>(t) * hd;
            const uint16_t* sn = sin + static_cast<int64_t>(t) * hd;
            for (int h = 0; h < n; ++h) {
                const uint16_t* xh = x + static_cast<int64_t>(t) * row_stride + static_cast<int64_t>(h) * hd;
                uint16_t* o = out + (static_cast<int64_t>(t) * n + h) * hd;
                if (norm_w) {
                    scale_row_bf16(xh, 1.f / std::sqrt(sumsq_bf16(xh, hd) / static_cast<float>(hd) + eps), norm_w + static_cast<int64_t>(h) * hd,
                                   normed.data(), hd);
                    xh = normed.data();
                }
                int i = 0;
#if defined(__AVX512F__)
                if (half % 16 == 0) {
                    for (; i < hd; i += 16) {
                        const int j = i < half ? i + half : i - half;
                        const __m512 a = round_bf16(_mm512_mul_ps(widen16(xh + i), widen16(c + i)));
                        const __m512 b = round_bf16(_mm512_mul_ps(widen16(xh + j), widen16(sn + i)));
                        narrow16(o + i, _mm512_add_ps(a, b));
                    }
                }
#elif defined(ITERSERVE_AVX2)
                if (half % 8 == 0) {
                    for (; i < hd; i += 8) {
                        const int j = i < half ? i + half : i - half;
                        const __m256 a = round_bf16_8(_mm256_mul_ps(widen8(xh + i), widen8(c + i)));
                        const __m256 b = round_bf16_8(_mm256_mul_ps(widen8(xh + j), widen8(sn + i)));
                        narrow8(o + i, _mm256_add_ps(a, b));
                    }
                }
#endif
                for (; i < hd; ++i) {
                    const int j = i < half ? i + half : i - half;
                    const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(xh[i]) * bf16_to_f32(c[i])));
                    const float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(xh[j]) * bf16_to_f32(sn[i])));
                    o[i] = f32_to_bf16(a + b);
                }
            }
        }
    }
}

// --- Uniform random numbers for sampling: Philox4x32-10 (Salmon et al., SC'11; the generator
// behind torch's and cuRAND's GPU streams), counter-based, so any element of any row is
// computed on its own and rows split across threads with the same result. torch's CPU
// exponential_ is a serial generator and a log an element, over an order of magnitude slower
// (docs/SPEED.md, "Sampling noise"); this is one pass of integer arithmetic.
constexpr uint32_t PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;

// The four words of Philox4x32-10 at counter c, key k (Random123's philox4x32_R(10, ...)).
inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; ++r) {
        const uint64_t p0 = uint64_t(PHILOX_M0) * c[0], p1 = uint64_t(PHILOX_M1) * c[2];
        const uint32_t n0 = uint32_t(p1 >> 32) ^ c[1] ^ k0, n2 = uint32_t(p0 >> 32) ^ c[3] ^ k1;
        c[1] = uint32_t(p1);
        c[3] = uint32_t(p0);
        c[0] = n0;
        c[2] = n2;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
}

// v in (0, 1) from a 32-bit word: (w + 1/2) / 2^32 in f32, at most the largest f32 below 1, so
// the sampler's noise -log(1 - v) is finite and positive (infinite noise on a row's only
// allowed token would hand the race to index 0; zero noise, 0 / 0). Small noise, where a race
// against an unlikely token is decided, keeps all 32 bits of resolution (docs/SAMPLING.md).
constexpr float PHILOX_V_MAX = 1.f - 1.f / 16777216.f;
inline float philox_unit(uint32_t w) {
    return std::min((static_cast<float>(w) + 0.5f) * (1.f / 4294967296.f), PHILOX_V_MAX);
}

#if defined(__AVX512F__)
// Philox4x32-10 on 16 counters at once (lanes), the same words as philox4x32_10.
inline void philox16(__m512i (&c)[4], uint32_t k0, uint32_t k1) {
    const __m512i m0 = _mm512_set1_epi32(static_cast<int>(PHILOX_M0)), m1 = _mm512_set1_epi32(static_cast<int>(PHILOX_M1));
    // the high 32 bits of each lane's 32 x 32-bit product: even lanes from one widening
    // multiply, odd lanes from another on the odd dwords
    auto mulhi = [](__m512i a, __m512i m) {
        const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(a, m), 32);
        const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
        return _mm512_mask_blend_epi32(0xAAAA, even, odd);
    };
    for (int r = 0; r < 10; ++r) {
        const __m512i h0 = mulhi(c[0], m0), h1 = mulhi(c[2], m1);
        const __m512i l0 = _mm512_mullo_epi32(c[0], m0), l1 = _mm512_mullo_epi32(c[2], m1);
        const __m512i n0 = _mm512_xor_si512(_mm512_xor_si512(h1, c[1]), _mm512_set1_epi32(static_cast<int>(k0)));
        const __m512i n2 = _mm512_xor_si512(_mm512_xor_si512(h0, c[3]), _mm512_set1_epi32(static_cast<int>(k1)));
        c[0] = n0;
        c[1] = l1;
        c[2] = n2;
        c[3] = l0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
}

// philox_unit of 16 words, the same f32 operations
inline __m512 philox_unit16(__m512i w) {
    const __m512 v = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(w), _mm512_set1_ps(0.5f)), _mm512_set1_ps(1.f / 4294967296.f));
    return _mm512_min_ps(v, _mm512_set1_ps(PHILOX_V_MAX));
}
#endif

// out [rows, n] f32: element j of row r is word (j % 64) / 16 of Philox4x32-10 at counter
// (j / 64 * 16 + j % 16, 0, 0, 0) with key keys[r] (low 32 bits, high 32 bits), as a float in
// (0, 1) (philox_unit). A group of 64 elements is 16 counters' four words, one word's 16 lanes
// contiguous, so the vector path stores whole vectors; the scalar path makes the same numbers.
void philox_uniform(const uint64_t* keys, int rows, int64_t n, float* out) {
    const int64_t groups = (n + 63) / 64;
#pragma omp parallel for schedule(static) collapse(2) if (int64_t(rows) * n >= PAR_MIN_ELEMS)
    for (int r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            const uint32_t k0 = static_cast<uint32_t>(keys[r]), k1 = static_cast<uint32_t>(keys[r] >> 32);
            float* o = out + static_cast<int64_t>(r) * n;
            const int64_t e0 = g * 64;
            alignas(64) float tmp[64];
            float* dst = e0 + 64 <= n ? o + e0 : tmp;  // the last, short group goes through tmp
#if defined(__AVX512F__)
            __m512i c[4];
            c[0] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g * 16)),
                                    _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
            c[1] = c[2] = c[3] = _mm512_setzero_si512();
            philox16(c, k0, k1);
            for (int w = 0; w < 4; ++w) _mm512_storeu_ps(dst + 16 * w, philox_unit16(c[w]));
#else
            for (int l = 0; l < 16; ++l) {
                uint32_t c[4] = {static_cast<uint32_t>(g * 16 + l), 0, 0, 0};
                philox4x32_10(c, k0, k1);
                for (int w = 0; w < 4; ++w) dst[16 * w + l] = philox_unit(c[w]);
            }
#endif
            if (dst == tmp)
                for (int64_t j = e0; j < n; ++j) o[j] = tmp[j - e0];
        }
    }
}

// One token per row by the exponential race on the Philox stream of philox_uniform: out[r] is
// the first index j of the largest l[r, j] / temps[r] - ln E[r, j], E = -ln(1 - v) of the row's
// uniform v at j (so argmax p / E, p the softmax of l / T: a draw from p). One pass, no
// softmax, noise or score arrays: the sampler's torch ops over 128 rows of a 49,152-token
// vocabulary took about four times this (docs/SPEED.md, "The race in one pass"). The division
// is IEEE's, as torch's, so a row divided by its temperature beforehand (temps 1) scores the
// same. floors (nullable): a token whose l / T is below floors[r] never wins (top-k, top-p,
// min-p as one cut), and of those equal to it only the first ties[r] by index can (ties
// nullable or < 0: all). -inf logits never win; a row of -inf gives 0. Returns 0, or -1 where not compiled in
// (has_race: AVX-512 only, the logs are vgetexp/vgetmant and a polynomial).
#if defined(__AVX512F__)
// ln x for 16 lanes of positive normal x: x = m 2^k with m in [0.75, 1.5) (vgetmantps), ln m
// = 2 atanh(t), t = (m - 1) / (m + 1), |t| <= 0.2, by its odd series to t^9 (truncation ~2e-9).
inline __m512 log_ps(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_src);
    __m512 k = _mm512_getexp_ps(x);
    // a mantissa >= 1.5 comes back halved, into [0.75, 1): its exponent is one more
    k = _mm512_mask_add_ps(k, _mm512_cmp_ps_mask(m, one, _CMP_LT_OQ), k, one);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
    const __m512 t2 = _mm512_mul_ps(t, t);
    __m512 p = _mm512_set1_ps(1.f / 9);
    p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.f / 7));
    p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.f / 5));
    p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.f / 3));
    p = _mm512_fmadd_ps(p, t2, one);
    return _mm512_fmadd_ps(k, _mm512_set1_ps(0.693147180559945309f), _mm512_mul_ps(_mm512_add_ps(t, t), p));
}
#endif

int philox_race(const float* logits, int rows, int n, const uint64_t* keys, const float* temps, const float* floors,
                const int32_t* ties, int64_t* out) {
#if defined(__AVX512F__)
    const int64_t groups = (int64_t(n) + 63) / 64;
#pragma omp parallel for schedule(static) if (int64_t(rows) * n >= PAR_MIN_ELEMS)
    for (int r = 0; r < rows; ++r) {
        const uint32_t k0 = static_cast<uint32_t>(keys[r]), k1 = static_cast<uint32_t>(keys[r] >> 32);
        const float* lr = logits + static_cast<int64_t>(r) * n;
        const __m512 temp = _mm512_set1_ps(temps[r]), one = _mm512_set1_ps(1.f), ninf = _mm512_set1_ps(-INFINITY);
        const __m512 floor = _mm512_set1_ps(floors ? floors[r] : -INFINITY);
        const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        // The scores are l / T - max - ln E: at a small T, l / T is large and without the
        // max its f32 steps would round the noise away (ties then going to the first).
        __m512 top = ninf;
        for (int64_t e0 = 0; e0 < n; e0 += 16) {
            const __mmask16 in = n - e0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - e0)) - 1);
            top = _mm512_max_ps(top, _mm512_div_ps(_mm512_mask_loadu_ps(ninf, in, lr + e0), temp));
        }
        const float m = _mm512_reduce_max_ps(top);
        const __m512 shift = _mm512_set1_ps(std::isfinite(m) ? m : 0.f);
        // Of the tokens equal to the floor only the first ties[r] by index stay (< 0: all):
        // the count a sort's cut keeps (top-k keeps exactly k).
        const int budget = ties ? ties[r] : -1;
        int seen = 0;
        __m512 best = ninf;
        __m512i best_j = _mm512_setzero_si512();
        for (int64_t g = 0; g < groups; ++g) {
            __m512i c[4];
            c[0] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g * 16)), lanes);
            c[1] = c[2] = c[3] = _mm512_setzero_si512();
            philox16(c, k0, k1);
            for (int w = 0; w < 4; ++w) {
                const int64_t e0 = g * 64 + 16 * w;
                if (e0 >= n) break;
                const __mmask16 in = n - e0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - e0)) - 1);
                const __m512 l = _mm512_mask_loadu_ps(ninf, in, lr + e0);
                // v as philox_unit; E = -ln(1 - v) = -log1p(-v), by Goldberg's log1p: ln u * v / (u - 1)
                // with u = 1 - v rounded, and v itself where u rounds to 1 (v < 2^-25)
                const __m512 v = philox_unit16(c[w]);
                const __m512 u = _mm512_sub_ps(one, v);
                const __m512 um1 = _mm512_sub_ps(u, one);
                const __mmask16 exact = _mm512_cmp_ps_mask(um1, _mm512_setzero_ps(), _CMP_NEQ_OQ);
                const __m512 e = _mm512_mask_div_ps(v, exact, _mm512_mul_ps(log_ps(u), v), um1);
                const __m512 lt = _mm512_div_ps(l, temp);
                const __m512 score = _mm512_sub_ps(_mm512_sub_ps(lt, shift), log_ps(e));
                __mmask16 ok = _mm512_mask_cmp_ps_mask(in, lt, floor, _CMP_GE_OQ);
                if (budget >= 0) {
                    __mmask16 eq = _mm512_mask_cmp_ps_mask(in, lt, floor, _CMP_EQ_OQ);
                    if (eq) {
                        const int cnt = __builtin_popcount(eq), left = std::max(0, budget - seen);
                        seen += cnt;
                        // keep the lowest `left` lanes of eq, drop the rest
                        for (int extra = cnt - left; extra > 0; --extra) {
                            const __mmask16 hi = __mmask16(1u << (31 - __builtin_clz(static_cast<unsigned>(eq))));
                            ok &= static_cast<__mmask16>(~hi);
                            eq &= static_cast<__mmask16>(~hi);
                        }
                    }
                }
                const __mmask16 gt = _mm512_mask_cmp_ps_mask(ok, score, best, _CMP_GT_OQ);
                best = _mm512_mask_mov_ps(best, gt, score);
                best_j = _mm512_mask_mov_epi32(best_j, gt, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(e0)), lanes));
            }
        }
        // the largest score, then the first index holding it (each lane kept its first)
        const float mx = _mm512_reduce_max_ps(best);
        const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ);
        out[r] = _mm512_mask_reduce_min_epi32(at, best_j);
    }
    return 0;
#else
    (void)logits, (void)rows, (void)n, (void)keys, (void)temps, (void)floors, (void)ties, (void)out;
    return -1;
#endif
}

// The smallest value of each row's top-p nucleus: x [rows, n] f32 (logits / T), the row sorted
// largest first, a token staying while the probability mass before it is below top_p[r] (the
// first always stays); out[r] = the last one's value and ties[r] how many tokens equal to it
// the cut keeps (-inf and -1 where top_p[r] >= 1 or the row is all -inf or NaN; +inf where
// it has +inf, which then are the nucleus). Without a sort: the max, the exps and their sum, then a histogram of mass over
// NUCLEUS_BUCKETS buckets of x (each NUCLEUS_RANGE / NUCLEUS_BUCKETS wide below the max, the
// last taking everything lower, never the cut's) finds the bucket where the mass crosses
// top_p, and only that bucket's tokens are sorted (torch's sort of 128 rows of 49,152 tokens:
// 260-300 ms, docs/SPEED.md).
constexpr int NUCLEUS_BUCKETS = 1024;
constexpr float NUCLEUS_RANGE = 32.f;  // e^-32 of the max: below it one bucket holds the rest

void top_p_floor(const float* x, int rows, int n, const float* top_p, float* out, int32_t* ties) {
    constexpr int TAIL = NUCLEUS_BUCKETS - 1;
#pragma omp parallel if (int64_t(rows) * n >= PAR_MIN_ELEMS)
    {
        // the mass adds up in f64: the cut then is the exact one, up to the exps' rounding
        std::vector<float> ex(n);
        std::vector<int32_t> bk(n);
        // TAIL's elements go to 16 spare slots by lane, not to one (a chain of dependent adds)
        std::vector<double> hmass(NUCLEUS_BUCKETS + 16);
        std::vector<int> hcount(NUCLEUS_BUCKETS + 16);
        std::vector<std::pair<float, float>> cand;  // (x, exp) of the crossing bucket
#pragma omp for schedule(static)
        for (int r = 0; r < rows; ++r) {
            const float* xr = x + static_cast<int64_t>(r) * n;
            out[r] = -INFINITY;
            ties[r] = -1;
            if (!(top_p[r] < 1.f)) continue;
            float m = -INFINITY;
            int i = 0;
#if defined(__AVX512F__)
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(xr + i));
            m = _mm512_reduce_max_ps(mx);
#endif
            for (; i < n; ++i) m = std::max(m, xr[i]);
            if (std::isnan(m) || m == -INFINITY) continue;  // no mass to cut: no floor
            if (m == INFINITY) {  // logits / T overflowed: the infinite tokens are the nucleus
                out[r] = INFINITY;
                continue;
            }
            const float per = NUCLEUS_BUCKETS / NUCLEUS_RANGE;
            // bucket 0 holds the max; a larger x never lands lower; TAIL takes everything below
            // e^-32 of the max (whose mass, under n e^-32 of the row's, is below what 1 - top_p
            // can be in f32, so the cut is never there)
            auto bucket = [&](float v, int j) {
                const float d = (m - v) * per;
                return d < TAIL ? static_cast<int32_t>(d) : NUCLEUS_BUCKETS + (j & 15);
            };
            double z = 0.;
            i = 0;
#if defined(__AVX512F__)
            __m512d z0 = _mm512_setzero_pd(), z1 = _mm512_setzero_pd();
            const __m512 mv = _mm512_set1_ps(m), pv = _mm512_set1_ps(per), tiny = _mm512_set1_ps(-87.f);
            const __m512 tail = _mm512_set1_ps(static_cast<float>(TAIL));
            const __m512i spare = _mm512_add_epi32(_mm512_set1_epi32(NUCLEUS_BUCKETS),
                                                   _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
            for (; i + 16 <= n; i += 16) {
                const __m512 v = _mm512_loadu_ps(xr + i);
                // exps below e^-87 would be subnormal, slow to add; their mass is nothing
                const __m512 dv = _mm512_sub_ps(v, mv);
                const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(dv, tiny, _CMP_GE_OQ), exp_ps(dv));
                _mm512_storeu_ps(ex.data() + i, e);
                z0 = _mm512_add_pd(z0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
                z1 = _mm512_add_pd(z1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
                const __m512 d = _mm512_mul_ps(_mm512_sub_ps(mv, v), pv);
                const __mmask16 in = _mm512_cmp_ps_mask(d, tail, _CMP_LT_OQ);
                _mm512_storeu_si512(bk.data() + i, _mm512_mask_mov_epi32(spare, in, _mm512_cvttps_epi32(_mm512_maskz_mov_ps(in, d))));
            }
            z = _mm512_reduce_add_pd(_mm512_add_pd(z0, z1));
#endif
            for (; i < n; ++i) {
                z += (ex[i] = xr[i] - m < -87.f ? 0.f : std::exp(xr[i] - m));
                bk[i] = bucket(xr[i], i);
            }
            const double target = static_cast<double>(top_p[r]) * z;
            std::fill(hmass.begin(), hmass.end(), 0.);
            std::fill(hcount.begin(), hcount.end(), 0);
            for (int j = 0; j < n; ++j) {
                hmass[bk[j]] += ex[j];
                ++hcount[bk[j]];
            }
            double before = 0.;
            int cross = -1;
            for (int b = 0; b < TAIL; ++b) {
                if (hcount[b] && before + hmass[b] >= target) {
                    cross = b;
                    break;
                }
                before += hmass[b];
            }
            if (cross < 0) {  // rounding left the row short of target: its lowest bucket
                cross = TAIL - 1;
                while (cross > 0 && !hcount[cross]) --cross;
                before -= hmass[cross];
            }
            cand.clear();
            int j = 0;
#if defined(__AVX512F__)
            const __m512i cv = _mm512_set1_epi32(cross);
            for (; j + 16 <= n; j += 16) {
                __mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(bk.data() + j), cv);
                for (; hit; hit &= hit - 1) {
                    const int l = j + __builtin_ctz(hit);
                    cand.emplace_back(xr[l], ex[l]);
                }
            }
#endif
            for (; j < n; ++j)
                if (bk[j] == cross) cand.emplace_back(xr[j], ex[j]);
            if (cand.empty()) continue;  // NaNs made the sums meaningless: no floor
            std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
            float tau = cand.front().first;
            int at_tau = 0;  // how many tokens equal to tau the cut keeps
            for (const auto& [v, e] : cand) {
                if (before >= target) break;
                at_tau = v == tau ? at_tau + 1 : 1;
                tau = v;
                before += e;
            }
            out[r] = tau;
            ties[r] = at_tau;
        }
    }
}

// The k largest values of each chosen row, largest first (torch.topk's values): x [*, n] f32,
// idx [m] the rows, ks [m] each one's k (1..n), out [m, kmax] (a row's places past its k are
// -inf). No sort of the row: the maxima of its blocks of 16 s elements (s chosen for ~4 k
// blocks) give a threshold that at least k of them reach, their k-th largest, so at least k
// elements do; one pass keeps the elements at or above it (a few k, usually), and only those
// are ordered. torch's topk of 128 rows of 49,152 took ~6 ms, and gathering the rows for it
// as much again (docs/SPEED.md). A row with a NaN takes the exact path, NaN the largest.
void top_k_values(const float* x, int n, const int64_t* idx, int m, const int32_t* ks, int kmax, float* out) {
    auto nan_largest = [](float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); };
#pragma omp parallel if (int64_t(m) * n >= PAR_MIN_ELEMS)
    {
        std::vector<float> cand(n + 16), maxima;  // 16 spare: a full vector stored at its end
#pragma omp for schedule(static)
        for (int r = 0; r < m; ++r) {
            const float* xr = x + idx[r] * static_cast<int64_t>(n);
            float* o = out + static_cast<int64_t>(r) * kmax;
            const int k = std::min(std::max(ks[r], 1), n);
            const int s = static_cast<int>(std::max<int64_t>(1, n / (int64_t(64) * k)));  // vectors a block
            const int bsize = 16 * s, nb = n / bsize;
            float t = -INFINITY;  // at least k elements are >= t
            bool nan = false;
            if (nb >= k) {
                maxima.resize(nb);
                for (int b = 0; b < nb; ++b) {
                    const float* xb = xr + static_cast<int64_t>(b) * bsize;
#if defined(__AVX512F__)
                    __m512 mx = _mm512_loadu_ps(xb);
                    __mmask16 un = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
                    for (int v = 1; v < s; ++v) {
                        const __m512 a = _mm512_loadu_ps(xb + 16 * v);
                        mx = _mm512_max_ps(mx, a);
                        un |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
                    }
                    nan |= un != 0;
                    maxima[b] = _mm512_reduce_max_ps(mx);
#else
                    float mx = xb[0];
                    for (int j = 0; j < bsize; ++j) {
                        nan |= std::isnan(xb[j]);
                        mx = std::max(mx, xb[j]);
                    }
                    maxima[b] = mx;
#endif
                }
                if (!nan) {
                    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
                    t = maxima[k - 1];
                }
            }
            int c = 0, j = 0;
            if (!nan) {
#if defined(__AVX512F__)
                const __m512 tv = _mm512_set1_ps(t);
                __mmask16 un = 0;
                for (; j + 16 <= n; j += 16) {
                    const __m512 a = _mm512_loadu_ps(xr + j);
                    un |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
                    const __mmask16 keep = _mm512_cmp_ps_mask(a, tv, _CMP_GE_OQ);
                    if (keep) {  // rare; compressing into a register, not memory (microcoded on Zen 4)
                        _mm512_storeu_ps(cand.data() + c, _mm512_maskz_compress_ps(keep, a));
                        c += __builtin_popcount(keep);
                    }
                }
                nan = un != 0;
#endif
                for (; j < n; ++j) {
                    nan |= std::isnan(xr[j]);
                    if (xr[j] >= t) cand[c++] = xr[j];
                }
            }
            if (nan) {  // the whole row, NaN ordered first (as torch.topk)
                std::copy(xr, xr + n, cand.begin());
                std::partial_sort(cand.begin(), cand.begin() + k, cand.begin() + n, nan_largest);
            } else {
                std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.begin() + c, std::greater<float>());
                std::sort(cand.begin(), cand.begin() + k, std::greater<float>());
            }
            std::copy(cand.begin(), cand.begin() + k, o);
            std::fill(o + k, o + kmax, -INFINITY);
        }
    }
}

// Index of each row's largest value, the first one on ties, a NaN counting as the largest (as
// torch.argmax). x [rows, n] f32 contiguous.
void argmax_f32(const float* x, int rows, int n, int64_t* out) {
#pragma omp parallel for schedule(static) if (int64_t(rows) * n >= PAR_MIN_ELEMS)
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + static_cast<int64_t>(r) * n;
        int64_t best = -1;
        int i = 0;
#if defined(__AVX512F__)
        __m512 m = _mm512_set1_ps(-INFINITY);
        bool nan = false;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(xr + i);
            if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) { nan = true; break; }
            m = _mm512_max_ps(m, v);
        }
        if (!nan) {
            float mx = _mm512_reduce_max_ps(m);
            for (int j = i; j < n; ++j) {
                if (std::isnan(xr[j])) { nan = true; break; }
                mx = std::fmax(mx, xr[j]);
            }
            if (!nan) {
                const __m512 mv = _mm512_set1_ps(mx);
                int j = 0;
                for (; j + 16 <= n && best < 0; j += 16) {
                    const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(xr + j), mv, _CMP_EQ_OQ);
                    if (k) best = j + __builtin_ctz(k);
                }
                for (; j < n && best < 0; ++j)
                    if (xr[j] == mx) best = j;
            }
        }
        if (best < 0) i = 0;  // a NaN somewhere (or no vector path): the scalar scan decides
#elif defined(ITERSERVE_AVX2)
        __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
        bool nan = false;
        for (; i + 16 <= n; i += 16) {
            const __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
            if (_mm256_movemask_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q))) { nan = true; break; }
            m0 = _mm256_max_ps(m0, v0);
            m1 = _mm256_max_ps(m1, v1);
        }
        if (!nan) {
            float mx = hmax8(_mm256_max_ps(m0, m1));
            for (int j = i; j < n; ++j) {
                if (std::isnan(xr[j])) { nan = true; break; }
                mx = std::fmax(mx, xr[j]);
            }
            if (!nan) {
                const __m256 mv = _mm256_set1_ps(mx);
                int j = 0;
                for (; j + 8 <= n && best < 0; j += 8) {
                    const int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(xr + j), mv, _CMP_EQ_OQ));
                    if (k) best = j + __builtin_ctz(k);
                }
                for (; j < n && best < 0; ++j)
                    if (xr[j] == mx) best = j;
            }
        }
#endif
        if (best < 0) {
            float mx = xr[0];
            best = 0;
            for (int j = 1; j < n; ++j) {
                if (std::isnan(mx)) break;
                if (std::isnan(xr[j]) || xr[j] > mx) { mx = xr[j]; best = j; }
            }
        }
        out[r] = best;
    }
}

// Decode attention over the paged cache. q [D, H, hd] in bf16 (io_f32 = 0) or f32, rows
// q_row_stride elements apart, heads contiguous; out [D, H, hd] contiguous, in q's dtype
// (rounded once at the end); k_cache/v_cache [slots, KvH, hd]
// in bf16 (cache_f32 = 0) or f32; block_tables [D, max_blocks] int64 (slot = block * block_size
// + offset); ctx_lens [D] (keys 0 .. ctx_len - 1 exist); starts [D] (first visible key: 0, or
// past a sliding window). Query heads h * G .. h * G + G - 1 share KV head h. ahead: software
// prefetch distance in positions, into L1 (negative: into L2; 0: none, the hardware
// prefetchers alone).
//
// A task is one sequence and a range of its KV heads (the whole range unless there are too few
// sequences to keep every thread busy): it walks the sequence's slots in order, and a slot's
// heads are adjacent in memory, so the task reads its cache rows as contiguous runs instead of
// one head's 128-byte piece every 1.5 KB. Where the sequences alone would leave a thread idle,
// or one sequence's keys alone would keep a thread busy past the others (and its keys are long
// enough), a task is instead every head over a part of one sequence's keys: whole rows, read at
// about the memory's rate where half rows were not (docs/SPEED.md, "Fewer sequences than
// threads split their keys", "A long sequence among short ones splits its keys").
// plan_decode says which. Pass 1 computes every score, then a vectorised softmax per query
// head, then pass 2 accumulates the V rows.
// With side_P (a weight [side_N, K] in pair panels or Pairs12 blocks, side_panel_bytes a panel,
// or null) each thread also prefetches its share of side_P into L2 over the positions it visits
// (SidePrefetch; decode_layer's).
constexpr int KSPLIT_MIN_KEYS = 32;  // keys a part at least, where decode_attention splits them

// One task of decode_attention: KV heads [h0, h1) of sequence d over its keys [begin, end).
// part >= 0: its slot in the parts' buffers (a sequence whose keys are split, merged after the
// loop by the parts' log-sum-exps); -1: it writes its output directly.
struct DecodeSpan {
    int d, h0, h1, part;
    int64_t begin, end;
};

// Keys times the share of the heads: a task's work in keys.
inline double span_work(const DecodeSpan& s, int KvH) {
    return static_cast<double>(s.end - s.begin) * (s.h1 - s.h0) / KvH;
}

// The longest a thread works when the plan's tasks go in its order (the longest first) each to
// the thread with the least so far: what decode_attention's dynamic schedule comes to.
static double lpt_makespan(const std::vector<DecodeSpan>& plan, int KvH, int threads) {
    std::priority_queue<double, std::vector<double>, std::greater<double>> load;  // the least on top
    for (int t = 0; t < threads; ++t) load.push(0.0);
    double most = 0;
    for (const DecodeSpan& s : plan) {
        const double l = load.top() + span_work(s, KvH);
        load.pop();
        load.push(l);
        most = std::max(most, l);
    }
    return most;
}

// plan = the spans of each sequence in ks[d] key parts (slots in order) or hs[d] head ranges,
// the longest first; returns the number of part slots.
static int build_plan(const int64_t* ctx_lens, const int64_t* starts, int D, int KvH, int block_size, const std::vector<int>& ks,
                      const std::vector<int>& hs, std::vector<DecodeSpan>& plan) {
    plan.clear();
    int slots = 0;
    for (int d = 0; d < D; ++d) {
        const int64_t b0 = starts[d], len = ctx_lens[d] - starts[d];
        if (ks[d] > 1) {  // part k of the keys, its bounds on whole blocks where they fit
            const int k_n = ks[d];
            const bool whole = static_cast<int64_t>(block_size) * k_n <= len;  // else uneven parts
            const auto bound = [&](int k) {
                const int64_t at = b0 + len * k / k_n;
                const int64_t rounded = at / block_size * block_size;
                return whole && rounded > b0 ? rounded : at;
            };
            for (int k = 0; k < k_n; ++k)
                plan.push_back({d, 0, KvH, slots++, k == 0 ? b0 : bound(k), k == k_n - 1 ? b0 + len : bound(k + 1)});
        } else {
            const int per = (KvH + hs[d] - 1) / hs[d];
            for (int h0 = 0; h0 < KvH; h0 += per) plan.push_back({d, h0, std::min(h0 + per, KvH), -1, b0, ctx_lens[d]});
        }
    }
    // the longest first (the schedule's order); equal ones keep the sequences' order
    std::stable_sort(plan.begin(), plan.end(),
                     [&](const DecodeSpan& x, const DecodeSpan& y) { return span_work(x, KvH) > span_work(y, KvH); });
    return slots;
}

// decode_attention's tasks for a step, the longest first; returns the number of part slots.
// First each sequence is split only until every thread gets as many tasks as the others (up to
// about 4 each; equal sequences then share the threads evenly, in parts small enough that
// the dynamic schedule evens out a thread that runs slower): its keys where every part keeps
// KSPLIT_MIN_KEYS (whole rows, read at about the memory's rate), else its heads (a task reads
// its heads' part of every row: fewer, wider tasks read longer runs; one sequence of 12 heads
// at 150 keys, cold, 2 tasks of 6 heads took 21 us a layer, 6 tasks of 2 heads 30;
// docs/SPEED.md, "One call per layer for decode steps"). Then, while the threads would still
// wait on the longest tasks (their work more than 10% past an even share, the tasks going
// longest first to the thread with the least so far), every task longer than a cap is split
// down to it (keys where the parts keep KSPLIT_MIN_KEYS, at most 4 parts a thread, else
// heads), the cap shrinking by 1.5x a round from the longest task.
static int plan_decode(const int64_t* ctx_lens, const int64_t* starts, int D, int KvH, int block_size, int threads,
                       std::vector<DecodeSpan>& plan) {
    plan.clear();
    if (D <= 0) return 0;
    const int max_parts = 4 * threads;
    const auto keys = [&](int d) { return std::max<int64_t>(ctx_lens[d] - starts[d], 0); };
    int parts = 1;
    while ((D * parts < threads || (D * parts) % threads != 0) && D * parts < max_parts) parts *= 2;
    std::vector<int> ks(static_cast<size_t>(D), 1), hs(static_cast<size_t>(D), 1);  // key parts, head splits
    double total = 0;
    for (int d = 0; d < D; ++d) {
        total += static_cast<double>(keys(d));
        if (parts > 1 && keys(d) >= static_cast<int64_t>(parts) * KSPLIT_MIN_KEYS)
            ks[d] = parts;
        else if (parts > 1)
            hs[d] = std::min(parts, KvH);
    }
    int slots = build_plan(ctx_lens, starts, D, KvH, block_size, ks, hs, plan);
    if (threads == 1 || total <= 0) return slots;
    const double share = total / threads;
    double longest = span_work(plan.front(), KvH);
    // dynamic scheduling ends within one task of an even share: no need to look closer
    if (longest * (threads - 1) <= 0.1 * share * threads || lpt_makespan(plan, KvH, threads) <= 1.1 * share) return slots;
    for (double cap = longest / 1.5; cap >= 1; cap /= 1.5) {
        bool split = false;
        for (int d = 0; d < D; ++d) {
            const double work = static_cast<double>(keys(d)) / ks[d] / hs[d];
            if (work <= cap) continue;
            const int want = static_cast<int>(std::ceil(static_cast<double>(keys(d)) / cap));
            const int fit = static_cast<int>(std::min<int64_t>(max_parts, keys(d) / KSPLIT_MIN_KEYS));
            if (hs[d] == 1 && std::min(want, fit) > ks[d]) {
                ks[d] = std::min(want, fit);
                split = true;
            } else if (ks[d] == 1 && hs[d] < KvH) {
                hs[d] = std::min(std::max(want, 2 * hs[d]), KvH);
                split = true;
            }
        }
        if (!split) continue;
        slots = build_plan(ctx_lens, starts, D, KvH, block_size, ks, hs, plan);
        if (lpt_makespan(plan, KvH, threads) <= 1.1 * share) break;
    }
    return slots;
}

// plan_decode's answer for the calling thread, kept while the step's lengths, starts and
// shapes stay the same: a decode step calls decode_attention once per layer with them.
struct DecodePlanCache {
    std::vector<int64_t> lens, starts;
    int KvH = -1, block_size = -1, threads = -1, slots = 0;
    std::vector<DecodeSpan> plan;
    // per sequence split into parts: its first slot (-1: not split) and how many (the parts
    // sit in consecutive slots); the merge after the loop reads them
    std::vector<int> first_part, num_parts;
    int get(const int64_t* ctx_lens, const int64_t* st, int D, int kvh, int bs, int nth) {
        const size_t n = static_cast<size_t>(std::max(D, 0));
        if (KvH != kvh || block_size != bs || threads != nth || lens.size() != n || !std::equal(lens.begin(), lens.end(), ctx_lens) ||
            !std::equal(starts.begin(), starts.end(), st)) {
            lens.assign(ctx_lens, ctx_lens + n);
            starts.assign(st, st + n);
            KvH = kvh;
            block_size = bs;
            threads = nth;
            slots = plan_decode(ctx_lens, st, D, kvh, bs, nth, plan);
            first_part.assign(n, -1);
            num_parts.assign(n, 0);
            for (const DecodeSpan& s : plan)
                if (s.part >= 0) {
                    ++num_parts[s.d];
                    if (first_part[s.d] < 0 || s.part < first_part[s.d]) first_part[s.d] = s.part;
                }
        }
        return slots;
    }
};

static void decode_attention(const void* q, int64_t q_row_stride, int io_f32, const void* k_cache, const void* v_cache, int cache_f32,
                             const int64_t* block_tables, const int64_t* ctx_lens, const int64_t* starts, void* out, int D, int H, int KvH,
                             int hd, int block_size, int max_blocks, float scale, int ahead, const void* side_P, int side_N,
                             int64_t side_panel_bytes) {
    const int G = H / KvH;
    const int dist = ahead < 0 ? -ahead : ahead;
    const int elem = cache_f32 ? 4 : 2;
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    static thread_local DecodePlanCache cache;  // the calling thread's: read through spans
    const int slots = cache.get(ctx_lens, starts, D, KvH, block_size, threads);
    const std::vector<DecodeSpan>& plan = cache.plan;
    const int tasks = static_cast<int>(plan.size());
    const DecodeSpan* const spans = plan.data();
    // the split sequences' parts: each one's output and log-sum-exps, merged into out after the loop
    static thread_local std::vector<float> part_out_buf, part_lse_buf;
    if (slots > 0) {
        part_out_buf.resize(static_cast<size_t>(slots) * H * hd);
        part_lse_buf.resize(static_cast<size_t>(slots) * H);
    }
    float* const part_out = part_out_buf.data();
    float* const part_lse = part_lse_buf.data();
#if defined(__AVX512F__) || defined(ITERSERVE_AVX2)
    const DecodeTask fast = cache_f32 ? nullptr : decode_task_for(hd);
#endif
    int64_t visits = 0;  // about how many positions a thread visits (both passes)
    if (side_P != nullptr) {
        for (const DecodeSpan& s : plan) visits += 2 * (s.end - s.begin);
        visits = visits / threads + 1;
    }
#pragma omp parallel
    {
        std::vector<float> scores, row(static_cast<size_t>(hd)), acc, qbuf;
#if defined(__AVX512F__) || defined(ITERSERVE_AVX2)
        std::vector<float> vbuf;
#endif
        if (visits > 0) {  // the whole share, spread over the visits (at most 64 lines at one)
            const auto [b, e] = thread_share((side_N + GP_COLS - 1) / GP_COLS);
            t_side.next = static_cast<const char*>(side_P) + b * side_panel_bytes;
            t_side.left = (e - b) * side_panel_bytes;
            t_side.lines = static_cast<int>(std::min<int64_t>(64, (t_side.left / 64 + visits - 1) / visits));
        }
        // nowait: a thread out of tasks fetches the rest of its share (all of it where it got
        // none: fewer tasks than threads) while the others finish
#pragma omp for schedule(dynamic, 1) nowait
        for (int t = 0; t < tasks; ++t) {
            const DecodeSpan& span = spans[t];
            const int d = span.d, h0 = span.h0, h1 = span.h1;
            const int64_t begin = span.begin, end = span.end;
            const int nq = (h1 - h0) * G;  // query heads in this task
            const int64_t n = end - begin;
            qbuf.resize(static_cast<size_t>(nq) * hd);
            load_row(q, io_f32, static_cast<int64_t>(d) * q_row_stride + static_cast<int64_t>(h0) * G * hd, nq * hd, qbuf.data());
            const float* qd = qbuf.data();
            const int64_t od = (static_cast<int64_t>(d) * H + static_cast<int64_t>(h0) * G) * hd;  // out offset
            const int64_t* bt = block_tables + static_cast<int64_t>(d) * max_blocks;
            float* lse = span.part >= 0 ? part_lse + static_cast<int64_t>(span.part) * H : nullptr;
            float* const part_dst = span.part >= 0 ? part_out + static_cast<int64_t>(span.part) * H * hd : nullptr;
            if (n <= 0) {
                acc.assign(static_cast<size_t>(nq) * hd, 0.f);
                if (lse != nullptr) {
                    std::fill(lse, lse + nq, -INFINITY);
                    std::copy(acc.begin(), acc.end(), part_dst);
                } else {
                    store_row(out, io_f32, od, nq * hd, acc.data());
                }
                continue;
            }
#if defined(__AVX512F__) || defined(ITERSERVE_AVX2)
            if (fast) {
                acc.resize(static_cast<size_t>(nq) * hd);
                fast(qd, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache), bt, block_size, begin, end, KvH, G, h0, h1,
                     scale, ahead, scores, vbuf, acc.data(), lse);
                if (lse != nullptr)
                    std::copy(acc.begin(), acc.end(), part_dst);
                else
                    store_row(out, io_f32, od, nq * hd, acc.data());
                continue;
            }
#endif
            const int64_t ldn = (n + 15) & ~int64_t(15);  // scores[qh * ldn + p]
            scores.assign(static_cast<size_t>(nq) * ldn, -INFINITY);
            // Visits heads [h0, h1) of every position in [begin, end) in order, each row widened
            // into `row`, the rows `dist` positions on prefetched.
            auto walk = [&](const void* cache, auto&& visit) {
                for (int64_t p = begin; p < end; ++p) {
                    const int64_t slot = bt[p / block_size] * block_size + p % block_size;
                    if (dist > 0 && p + dist < end) prefetch_heads(cache, elem, bt, block_size, p + dist, KvH, hd, h0, h1, ahead < 0);
                    for (int h = h0; h < h1; ++h) {
                        load_row(cache, cache_f32, (slot * KvH + h) * hd, hd, row.data());
                        for (int g = 0; g < G; ++g) visit(p - begin, (h - h0) * G + g);
                    }
                }
            };
            // Pass 1: scores[qh, p] = q_qh . k_p * scale.
            walk(k_cache, [&](int64_t i, int qh) {
                scores[qh * ldn + i] = dot(qd + static_cast<int64_t>(qh) * hd, row.data(), hd) * scale;
            });
            for (int qh = 0; qh < nq; ++qh) {
                const float l = softmax_inplace(scores.data() + qh * ldn, n, ldn);
                if (lse != nullptr) lse[qh] = l;
            }
            // Pass 2: out_qh = sum_p scores[qh, p] * v_p.
            acc.assign(static_cast<size_t>(nq) * hd, 0.f);
            walk(v_cache, [&](int64_t i, int qh) {
                axpy(scores[qh * ldn + i], row.data(), acc.data() + static_cast<int64_t>(qh) * hd, hd);
            });
            if (lse != nullptr)
                std::copy(acc.begin(), acc.end(), part_dst);
            else
                store_row(out, io_f32, od, nq * hd, acc.data());
        }
        if (t_side.left > 0) {
            t_side.lines = static_cast<int>(t_side.left / 64 + 1);
            t_side.step();
        }
        t_side = SidePrefetch{};
    }
    if (slots > 0) {  // out = sum over parts of exp(lse_part - lse_all) * out_part, per head
        std::vector<float> merged(static_cast<size_t>(H) * hd);
        for (int d = 0; d < D; ++d) {
            if (cache.first_part[d] < 0) continue;
            const int64_t t0 = cache.first_part[d];
            const int kn = cache.num_parts[d];
            for (int qh = 0; qh < H; ++qh) {
                float m = -INFINITY;
                for (int k = 0; k < kn; ++k) m = std::fmax(m, part_lse[(t0 + k) * H + qh]);
                float z = 0.f;
                for (int k = 0; k < kn; ++k) z += std::exp(part_lse[(t0 + k) * H + qh] - m);
                float* o = merged.data() + static_cast<int64_t>(qh) * hd;
                std::fill(o, o + hd, 0.f);
                for (int k = 0; k < kn; ++k) {
                    const float w = std::exp(part_lse[(t0 + k) * H + qh] - m) / z;
                    if (w != 0.f) axpy(w, part_out + ((t0 + k) * H + qh) * hd, o, hd);  // NaN stays NaN
                }
            }
            store_row(out, io_f32, static_cast<int64_t>(d) * H * hd, H * hd, merged.data());
        }
    }
}
// decode_attention's plan for `threads` threads (tests and benchmarks read it): up to cap tasks
// as rows of (sequence, first KV head, end KV head, part slot or -1, first key, end key), in
// the schedule's order; returns the number of tasks.
int decode_attention_plan(const int64_t* ctx_lens, const int64_t* starts, int D, int KvH, int block_size, int threads, int64_t* out,
                          int cap) {
    std::vector<DecodeSpan> plan;
    plan_decode(ctx_lens, starts, D, KvH, block_size, threads, plan);
    for (int t = 0; t < static_cast<int>(plan.size()) && t < cap; ++t) {
        const DecodeSpan& s = plan[t];
        const int64_t row[6] = {s.d, s.h0, s.h1, s.part, s.begin, s.end};
        std::copy(row, row + 6, out + 6 * static_cast<int64_t>(t));
    }
    return static_cast<int>(plan.size());
}
// The library's entry point: decode_attention without a side prefetch.
void paged_decode_attention(const void* q, int64_t q_row_stride, int io_f32, const void* k_cache, const void* v_cache, int cache_f32,
                            const int64_t* block_tables, const int64_t* ctx_lens, const int64_t* starts,
                            void* out, int D, int H, int KvH, int hd, int block_size, int max_blocks, float scale, int ahead) {
    decode_attention(q, q_row_stride, io_f32, k_cache, v_cache, cache_f32, block_tables, ctx_lens, starts, out, D, H, KvH, hd, block_size,
                     max_blocks, scale, ahead, nullptr, 0, 0);
}

// 1 when the bf16 dot-product kernels (gemm_pairs, and paged_prefill_attention's bf16 form)
// are compiled in (AVX512-BF16), else 0.
int has_bf16_dot() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// Causal attention of one prefill chunk, bf16 (AVX512-BF16 dot products, or f32 FMA on AVX2): q [n, H, hd] (rows q_row_stride apart, heads
// contiguous) at positions p0 .. p0 + n - 1, against keys 0 .. p0 + n - 1 read from the paged
// caches [slots, KvH, hd] through block_ids (the chunk's blocks covering those positions);
// out [n, H * hd]. hd must be a multiple of 64. Returns 0, or -1 where not compiled in.
int paged_prefill_attention(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                            const int64_t* block_ids, int block_size, int n, int p0, int H, int KvH, int hd, float scale,
                            uint16_t* out) {
#if defined(__AVX512BF16__)
    const int ctx = p0 + n;
    const int ctx_pad = (ctx + PF_KB - 1) / PF_KB * PF_KB;
    const int G = H / KvH;
    const int64_t head_elems = static_cast<int64_t>(ctx_pad) * hd;
    // Not a fresh vector: its zero fill was a large part of the packing (docs/SPEED.md).
    const Scratch<uint16_t> kv(static_cast<size_t>(2 * KvH) * head_elems);
    uint16_t* Kp = kv.data;
    uint16_t* Vp = Kp + static_cast<size_t>(KvH) * head_elems;
    const int groups = ctx_pad / 16;
    // Pack: task = (16 keys, KV head), a group's heads in turn: a slot's row holds every head,
    // so a thread reads its groups' rows whole and in order, where head by head it came back to
    // each row once a head, for that head's bytes only (docs/SPEED.md, "The K / V packing group
    // by group").
#pragma omp parallel for schedule(static)
    for (int t = 0; t < KvH * groups; ++t) {
        const int kh = t % KvH, g = t / KvH;
        uint32_t* kd = reinterpret_cast<uint32_t*>(Kp + kh * head_elems + static_cast<int64_t>(g) * 16 * hd);
        uint32_t* vd = reinterpret_cast<uint32_t*>(Vp + kh * head_elems + static_cast<int64_t>(g) * 16 * hd);
        const uint16_t* src_k[16];
        const uint16_t* src_v[16];
        for (int u = 0; u < 16; ++u) {
            const int key = g * 16 + u;
            if (key < ctx) {
                const int64_t slot = block_ids[key / block_size] * block_size + key % block_size;
                src_k[u] = k_cache + (slot * KvH + kh) * hd;
                src_v[u] = v_cache + (slot * KvH + kh) * hd;
            } else {
                src_k[u] = src_v[u] = nullptr;  // keys past ctx: zeros
            }
        }
        // K: the 16 keys' rows of hd / 2 pairs, transposed 16 pairs at a time into [hd / 2][16]
        // (not one 4-byte store per pair).
        for (int c0 = 0; c0 < hd / 2; c0 += 16) {
            __m512i r[16];
            for (int u = 0; u < 16; ++u) r[u] = src_k[u] ? _mm512_loadu_si512(src_k[u] + 2 * c0) : _mm512_setzero_si512();
            transpose16x16_epi32(r);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kd + (c0 + j) * 16, r[j]);
        }
        // V: keys kk, kk + 1 interleaved per output column.
        for (int kk = 0; kk < 16; kk += 2) {
            uint32_t* vrow = vd + (kk / 2) * hd;
            for (int e = 0; e < hd; e += 16) {
                const __m512i a = src_v[kk] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src_v[kk] + e))) : _mm512_setzero_si512();
                const __m512i b = src_v[kk + 1] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src_v[kk + 1] + e))) : _mm512_setzero_si512();
                _mm512_storeu_si512(vrow + e, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        }
    }
    const int qblocks = (n + PF_QB - 1) / PF_QB;
    const int tasks = H * qblocks;
#if defined(ITERSERVE_AMX)
    const bool tiles = amx_permitted();
    if (tiles && (hd == 64 || hd == 128)) {
        // Tasks of 16 rows, head by head (a head's packed K and V, 2 x 2 x hd bytes a key, stay
        // in the thread's L2 across its tasks), later rows first: they see more keys.
        const int groups = (n + 15) / 16;
        const int nb_max = ctx_pad / 32;  // at least the key blocks of any task
#pragma omp parallel
        {
            const FlushDenormals ftz;
            alignas(64) float Ob[16 * 64], S[2 * 16 * 32], m[16], l[16 * 16];
            alignas(64) uint16_t Qb[16 * 128], Pb[2 * 16 * 32];
            // head_dim 128: every block's P and rescale factors, for the second pass
            // (P's rows are stored 64-byte aligned: Pall starts on a 64-byte boundary)
            std::vector<uint16_t> pall_buf(hd == 128 ? static_cast<size_t>(nb_max) * 16 * 32 + 32 : 0);
            uint16_t* Pall = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(pall_buf.data()) + 63) & ~uintptr_t(63));
            std::vector<float> corr(hd == 128 ? static_cast<size_t>(nb_max) * 16 : 0);
            std::vector<unsigned> moved(hd == 128 ? nb_max : 0);
            amx_configure_square();
#pragma omp for schedule(dynamic, 1)
            for (int t = 0; t < H * groups; ++t) {
                const int h = t / groups, b = groups - 1 - t % groups;
                const int r0 = b * 16, r1 = std::min(n, r0 + 16);
                if (hd == 64)
                    prefill_rows_amx64(q, q_row_stride, Kp + (h / G) * head_elems, Vp + (h / G) * head_elems, h, r0, r1, p0, scale, out,
                                       static_cast<int64_t>(H) * hd, Ob, m, l, Qb, S, Pb);
                else
                    prefill_rows_amx128(q, q_row_stride, Kp + (h / G) * head_elems, Vp + (h / G) * head_elems, h, r0, r1, p0, scale, out,
                                        static_cast<int64_t>(H) * hd, Ob, m, l, Qb, S, Pall, corr.data(), moved.data());
            }
            _tile_release();
        }
        return 0;
    }
#endif
#pragma omp parallel
    {
        const FlushDenormals ftz;
        // PF_QB + 16 rows: prefill_task's tiles of PF_R rows and the AMX task's of 16 both fit
        std::vector<float> O(static_cast<size_t>(PF_QB + 16) * hd), m(PF_QB + 16), l(16 * (PF_QB + 16));
#if defined(ITERSERVE_AMX)
        std::vector<uint16_t> Qb(tiles ? static_cast<size_t>(PF_QB + 32) * hd : 0);
        alignas(64) float S[2 * 32 * PF_KB];
        alignas(64) uint16_t Pb[16 * PF_KB];
        if (tiles) amx_configure_square();
#endif
        // Later query blocks see more keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; ++t) {
            const int b = qblocks - 1 - t / H, h = t % H;
            const int r0 = b * PF_QB, r1 = std::min(n, r0 + PF_QB);
            const int kh = h / G;
#if defined(ITERSERVE_AMX)
            if (tiles) {
                prefill_task_amx(q, q_row_stride, Kp + kh * head_elems, Vp + kh * head_elems, h, r0, r1, p0, hd, scale, out,
                                 static_cast<int64_t>(H) * hd, O.data(), m.data(), l.data(), Qb.data(), S, Pb);
                continue;
            }
#endif
            prefill_task(q, q_row_stride, Kp + kh * head_elems, Vp + kh * head_elems, h, r0, r1, p0, hd, scale, out,
                         static_cast<int64_t>(H) * hd, O.data(), m.data(), l.data());
        }
#if defined(ITERSERVE_AMX)
        if (tiles) _tile_release();
#endif
    }
    return 0;
#elif defined(ITERSERVE_AVX2)
    const int ctx = p0 + n;
    const int ctx_pad = (ctx + PA_KB - 1) / PA_KB * PA_KB;
    const int G = H / KvH;
    const int64_t head_elems = static_cast<int64_t>(ctx_pad) * hd;
    // No page faults and no zero fill per call.
    const Scratch<float> kv(static_cast<size_t>(2 * KvH * head_elems));
    float* Kp = kv.data;
    float* Vp = Kp + KvH * head_elems;
    const int groups = ctx_pad / 16;
    // Widen: task = (16 keys, KV head), a group's heads in turn (as the AVX-512 packing);
    // K transposed per 16 keys, keys past ctx zero.
#pragma omp parallel for schedule(static)
    for (int t = 0; t < KvH * groups; ++t) {
        const int kh = t % KvH, g = t / KvH;
        float* kd = Kp + kh * head_elems + static_cast<int64_t>(g) * 16 * hd;
        float* vd = Vp + kh * head_elems + static_cast<int64_t>(g) * 16 * hd;
        for (int u = 0; u < 16; ++u) {
            const int key = g * 16 + u;
            if (key < ctx) {
                const int64_t slot = block_ids[key / block_size] * block_size + key % block_size;
                const uint16_t* sk = k_cache + (slot * KvH + kh) * hd;
                const uint16_t* sv = v_cache + (slot * KvH + kh) * hd;
                for (int d = 0; d < hd; ++d) kd[d * 16 + u] = bf16_to_f32(sk[d]);
                for (int e = 0; e < hd; e += 8) _mm256_storeu_ps(vd + u * hd + e, widen8(sv + e));
            } else {
                for (int d = 0; d < hd; ++d) kd[d * 16 + u] = 0.f;
                std::memset(vd + u * hd, 0, sizeof(float) * hd);
            }
        }
    }
    const int qblocks = (n + PA_QB - 1) / PA_QB;
    const int tasks = H * qblocks;
#pragma omp parallel
    {
        std::vector<float> Qf(static_cast<size_t>(PA_QB + PA_R) * hd), O(static_cast<size_t>(PA_QB + PA_R) * hd);
        std::vector<float> m(PA_QB + PA_R), l(8 * (PA_QB + PA_R));
        // Later query blocks see more keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; ++t) {
            const int b = qblocks - 1 - t / H, h = t % H;
            const int r0 = b * PA_QB, r1 = std::min(n, r0 + PA_QB);
            const int kh = h / G;
            prefill_task_avx2(q, q_row_stride, Kp + kh * head_elems, Vp + kh * head_elems, h, r0, r1, p0, hd, scale, out,
                              static_cast<int64_t>(H) * hd, Qf.data(), O.data(), m.data(), l.data());
        }
    }
    return 0;
#else
    (void)q; (void)q_row_stride; (void)k_cache; (void)v_cache; (void)block_ids; (void)block_size; (void)n; (void)p0;
    (void)H; (void)KvH; (void)hd; (void)scale; (void)out;
    return -1;
#endif
}

// 1 when philox_race is compiled in (AVX-512), else 0.
int has_race() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// 1 when paged_prefill_attention is compiled in: bf16 dot products (AVX512-BF16) or f32 FMA on
// AVX2 without AVX-512.
int has_prefill_kernel() {
#if defined(__AVX512BF16__) || defined(ITERSERVE_AVX2)
    return 1;
#else
    return 0;
#endif
}

// cache[slots[t]] = src[t] for t < T: rows of row_bytes, src rows src_stride_bytes apart (the
// K or V columns of a fused projection). torch's index_copy_ moves ~1 GB/s here.
void write_rows(const void* src, int64_t src_stride_bytes, void* cache, const int64_t* slots, int T, int64_t row_bytes) {
#pragma omp parallel for schedule(static) if (int64_t(T) * row_bytes >= 2 * PAR_MIN_ELEMS)
    for (int t = 0; t < T; ++t)
        std::memcpy(static_cast<char*>(cache) + slots[t] * row_bytes, static_cast<const char*>(src) + t * src_stride_bytes, row_bytes);
}

// Lays out W [N, K] (bf16, row-major) as pair panels for gemm_pairs: ceil(N / 64) panels of
// ceil(K / 2) x 64 x 2 bf16; columns past N and the K value past an odd K are zero.
void pack_bf16_pairs(const uint16_t* W, uint16_t* P, int N, int K) {
    const int K2 = (K + 1) / 2, panels = (N + GP_COLS - 1) / GP_COLS;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p)
        for (int j = 0; j < K2; ++j)
            for (int col = 0; col < GP_COLS; ++col)
                for (int u = 0; u < 2; ++u) {
                    const int n = p * GP_COLS + col, k = 2 * j + u;
                    P[((static_cast<int64_t>(p) * K2 + j) * GP_COLS + col) * 2 + u] = n < N && k < K ? W[static_cast<int64_t>(n) * K + k] : 0;
                }
}

}  // extern "C"

namespace {
// GLU: y [M, N / 2] is SwiGLU of the product, for P packed from gate_up in GLU_BLOCK's layout
// and N a multiple of 64 (pair_tile's GLU). ARG: y is an ArgRows per thread (pair_tile's ARG).
template <bool F32, bool GLU = false, bool ARG = false>
int gemm_pairs_impl(const uint16_t* P, const uint16_t* x, void* y, const uint16_t* bias, int M, int N, int K) {
#if defined(__AVX512BF16__)
    const int K2 = K / 2, panels = (N + GP_COLS - 1) / GP_COLS;
    const int64_t ldy = GLU ? N / 2 : N;
    // A panel's first row tile reads it from memory and the later tiles from L2, so memory and
    // arithmetic would take turns. With 12 rows or more, the first 2 (24 rows or more: 4) full
    // tiles prefetch the thread's next panel (4 K2 lines) instead, 2 (1) lines a k pair each.
    // With fewer rows the GEMM is bound by memory, and the hardware prefetcher does best alone
    // (docs/SPEED.md, "The pair GEMM prefetches the next panel"). Each thread takes one
    // contiguous range of panels, so "next" is never another thread's panel.
    const int64_t panel_elems = static_cast<int64_t>(K2) * GP_COLS * 2;
    const int pf_tiles = M >= 24 ? 4 : M >= 12 ? 2 : 0;
#pragma omp parallel
    {
        const auto [p_begin, p_end] = thread_share(panels);
        void* yt = y;
#if defined(_OPENMP)
        if constexpr (ARG) yt = static_cast<ArgRows*>(y) + omp_get_thread_num();
#endif
        for (int p = p_begin; p < p_end; ++p) {
            const uint16_t* Pp = P + p * panel_elems;
            const int n0 = p * GP_COLS;
            int m0 = 0;
            if (pf_tiles > 0 && p + 1 < p_end) {
                // 4 K2 lines split evenly: tile t fetches K2 Q lines from line t K2 Q on
                const char* nxt = reinterpret_cast<const char*>(Pp + panel_elems);
                const int64_t share = panel_elems * 2 / pf_tiles;  // bytes each tile fetches
                for (int t = 0; t < pf_tiles; ++t, m0 += 6) {
                    if (pf_tiles == 4)
                        pair_tile<6, 1, F32, GLU, ARG>(Pp, x, K, bias, yt, ldy, N, K2, n0, m0, nxt + t * share);
                    else
                        pair_tile<6, 2, F32, GLU, ARG>(Pp, x, K, bias, yt, ldy, N, K2, n0, m0, nxt + t * share);
                }
            }
            for (; M - m0 >= 6; m0 += 6) pair_tile<6, 0, F32, GLU, ARG>(Pp, x, K, bias, yt, ldy, N, K2, n0, m0);
            if (M - m0 >= 4) { pair_tile<4, 0, F32, GLU, ARG>(Pp, x, K, bias, yt, ldy, N, K2, n0, m0); m0 += 4; }
            if (M - m0 >= 2) { pair_tile<2, 0, F32, GLU, ARG>(Pp, x, K, bias, yt, ldy, N, K2, n0, m0); m0 += 2; }
            if (M - m0 >= 1) pair_tile<1, 0, F32, GLU, ARG>(Pp, x, K, bias, yt, ldy, N, K2, n0, m0);
        }
    }
    return 0;
#else
    (void)P; (void)x; (void)y; (void)bias; (void)M; (void)N; (void)K;
    return -1;
#endif
}
#if defined(__AVX512BF16__)
// out[M]: each row's argmax over what run(ArgRows per thread) folded in (argmax_f32's answer:
// the first index of the maximum, a NaN the largest); run returns 0, else this returns -1.
template <typename Run>
int argmax_rows(int M, int64_t* out, Run&& run) {
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    // Each thread's rows on cache lines of its own (64 floats apart, from a 64-byte boundary):
    // the threads update them on every column tile, and a shared line moved between the cores
    // at each update.
    const size_t per = static_cast<size_t>(M) * 16 + 16;
    std::vector<float> best(threads * per + 16, -INFINITY);
    std::vector<int32_t> idx(best.size(), INT32_MAX);
    float* b0 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(best.data()) + 63) & ~uintptr_t(63));
    int32_t* i0 = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(idx.data()) + 63) & ~uintptr_t(63));
    std::vector<ArgRows> st(threads);
    for (int t = 0; t < threads; ++t) st[t] = ArgRows{b0 + t * per, i0 + t * per};
    if (run(st.data()) != 0) return -1;
    for (int r = 0; r < M; ++r) {
        float bv = -INFINITY;
        int32_t bi = INT32_MAX;
        bool bnan = false;
        for (int t = 0; t < threads; ++t)
            for (int j = 0; j < 16; ++j) {
                const float v = st[t].best[r * 16 + j];
                const int32_t i = st[t].idx[r * 16 + j];
                if (i == INT32_MAX) continue;  // this lane never took a column
                const bool nan = std::isnan(v);
                // a NaN beats any number; among NaNs, or equal numbers, the first column
                if (nan ? !bnan || i < bi : !bnan && (v > bv || (v == bv && i < bi))) {
                    bv = v;
                    bi = i;
                    bnan = nan;
                }
            }
        out[r] = bi == INT32_MAX ? 0 : bi;  // every value -inf: the first column
    }
    return 0;
}
#endif
#if defined(ITERSERVE_AMX)
// --- The pair GEMM on AMX tiles ---------------------------------------------------------------
// A pair panel's lines (one k pair, 64 columns x 2 bf16, 256 bytes) are already the layout
// TDPBF16PS takes for B: 16 consecutive lines, 64 bytes each at a stride of 256, are one B tile
// (16 k pairs x 16 columns). So the same packed weight serves gemm_pairs and gemm_amx, and a
// tile product does 16 x 16 x 32 multiply-adds in one instruction: at decode row counts the
// GEMM is bound by streaming the weight alone, at prefill row counts by the tiles' rate.
// Tiles: 0-3 accumulators C (rows x 16 f32), 4-5 x rows A (rows x 32 bf16), 5-7 weights B.
// Two shapes: one row block of up to 16 rows against a whole panel (NT = 4 column groups: C0-3,
// A4, B5-7), or two row blocks of up to 16 against a half panel (NT = 2: C0-3, A4-5, B6-7).

void amx_configure(int nt, int r0, int r1) {
    TileConfig c{};
    c.palette = 1;
    const int rows[8] = {r0, r0, nt == 4 ? r0 : r1, nt == 4 ? r0 : r1, r0, nt == 4 ? 16 : r1, 16, 16};
    for (int t = 0; t < 8; ++t)
        if (rows[t] > 0) {
            c.rows[t] = static_cast<uint8_t>(rows[t]);
            c.colsb[t] = 64;
        }
    _tile_loadconfig(&c);
}

// The epilogue of a unit (amx_unit) whose accumulators sit in cb, for its rows r0 .. r1 - 1:
// y's values (store_cols), the running argmax (ARG, y an ArgRows) or SwiGLU (GLU, glu_store).
// Row by row, so a unit's epilogue can be run in slices.
template <int NT, bool F32, bool ARG, bool GLU>
void amx_epilogue(const float* cb, void* y, int N, const uint16_t* bias, int n0, int m0, int r0, int r1) {
    constexpr int LDC = NT * 16;  // f32 per row of cb
    if (r1 <= r0) return;
    const float* c0 = cb + static_cast<int64_t>(r0) * LDC;
    if constexpr (GLU) {
        // the weight's gate and up columns alternate in blocks of 16 (GLU_BLOCK): group 2j of
        // cb holds gate columns n0 + 16 j.., group 2j + 1 their up columns
        static_assert(GLU_BLOCK == 16, "a column group of the tiles");
        for (int j = 0; j < NT / 2; ++j)
            glu_store(static_cast<uint16_t*>(y), N, bias, n0 + 16 * j, m0 + r0, r1 - r0, [&](int r) { return _mm512_loadu_ps(c0 + r * LDC + 32 * j); },
                      [&](int r) { return _mm512_loadu_ps(c0 + r * LDC + 32 * j + 16); });
        return;
    }
    for (int c = 0; c < NT && n0 + 16 * c < N; ++c) {
        auto acc = [&](int r) { return _mm512_loadu_ps(c0 + r * LDC + 16 * c); };
        if constexpr (ARG)
            argmax_cols(*static_cast<const ArgRows*>(y), bias, N, n0 + 16 * c, m0 + r0, r1 - r0, acc);
        else
            store_cols<F32>(y, N, bias, N, n0 + 16 * c, m0 + r0, r1 - r0, acc);
    }
}

// The tile products of rows m0 .. m0 + rows - 1 (rows <= 16, or <= 32 with TWO) of y against NT
// column groups of 16 starting at column n0, whose B tiles start at Bp (line stride 256 bytes),
// stored to cb (32 x 64 f32) for amx_epilogue. During each k step, once its products are
// issued, during(kb, K / 32) runs: vector work there (the previous unit's epilogue) overlaps
// the tile products, where after them it would wait for them and they for it.
// Each k step also prefetches pf_bytes from pf on (into L2), where pf is given (NT = 2 only).
template <int NT, bool TWO, typename During>
void amx_unit(const uint16_t* Bp, const uint16_t* x, int K, int m0, float* cb, During&& during, const char* pf = nullptr, int pf_bytes = 0) {
    static_assert(NT == 4 || NT == 2, "column groups");
    static_assert(!(TWO && NT == 4), "two row blocks take a half panel");
    constexpr int LINE = GP_COLS * 2;  // uint16 per pair-panel line
    const int64_t ldx = static_cast<int64_t>(K) * 2;
    const uint16_t* xa = x + static_cast<int64_t>(m0) * K;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NT == 4 || TWO) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int kb = 0; kb < K / 32; ++kb) {
        const uint16_t* b = Bp + static_cast<int64_t>(kb) * 16 * LINE;
        if (pf)
            for (int off = 0; off < pf_bytes; off += 64) _mm_prefetch(pf + static_cast<int64_t>(kb) * pf_bytes + off, _MM_HINT_T1);
        const uint16_t* bq = b + NT / 2 * 32;  // the second half of the unit's columns
        _tile_loadd(4, xa + kb * 32, ldx);
        if constexpr (NT == 4) {
            _tile_loadd(5, b, LINE * 2);
            _tile_loadd(6, b + 32, LINE * 2);
            _tile_loadd(7, bq, LINE * 2);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, bq + 32, LINE * 2);
            _tile_dpbf16ps(3, 4, 5);
        } else {
            _tile_loadd(6, b, LINE * 2);
            _tile_loadd(7, bq, LINE * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if constexpr (TWO) {
                _tile_loadd(5, xa + 16 * static_cast<int64_t>(K) + kb * 32, ldx);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        during(kb, K / 32);
    }
    constexpr int LDC = NT * 16;  // f32 per row of cb
    _tile_stored(0, cb, LDC * 4);
    _tile_stored(1, cb + 16, LDC * 4);
    if constexpr (NT == 4) {
        _tile_stored(2, cb + 32, LDC * 4);
        _tile_stored(3, cb + 48, LDC * 4);
    } else if constexpr (TWO) {
        _tile_stored(2, cb + 16 * LDC, LDC * 4);
        _tile_stored(3, cb + 16 * LDC + 16, LDC * 4);
    }
}

// The most rows whose GEMM runs a unit's epilogue during the next unit's products (see below).
constexpr int DEFER_MAX_ROWS = 1024;

// ARG: y is an ArgRows per thread (ArgRows[omp_get_max_threads()]), each row's argmax folded
// into the calling thread's instead of storing y; returns -1 where the tiles cannot run it.
// GLU: P packs a gate and up weight [2N, K] (N % 32 == 0) whose rows alternate in blocks of 16
// (GLU_BLOCK: gate rows 0-15, up rows 0-15, gate rows 16-31, ...) and y [M, N] bf16 is its
// SwiGLU output (glu_store); -1 likewise. So a unit's gate and up columns share its panel's
// lines, which it reads as the plain GEMM does: with the gate and up weights one after the
// other, a unit read a quarter of each line (past 16 rows; half up to 16) in two panels, and at
// K = 2,048 its weight streamed 10-30% slower (docs/SPEED.md, "Gate and up in one panel line").
template <bool F32, bool ARG = false, bool GLU = false>
int gemm_amx_impl(const uint16_t* P, const uint16_t* x, void* y, const uint16_t* bias, int M, int N, int K) {
    if (K % 32 || !amx_permitted()) {
        if constexpr (ARG || GLU) return -1;
        else return gemm_pairs_impl<F32>(P, x, y, bias, M, N, K);
    }
    const int64_t panel_elems = static_cast<int64_t>(K / 2) * GP_COLS * 2;
    // up to 16 rows: whole panels, each line streamed once; more: half panels, 32 rows a block
    const int nt = M <= 16 ? 4 : 2;
    // a unit's columns of y (GLU: gate columns, each with its up column), and per panel
    const int ucols = GLU ? nt * 8 : nt * 16, upp = GP_COLS / (nt * 16);
    const int units = (N + ucols - 1) / ucols, mstep = nt == 4 ? 16 : 32;
    auto at = [&](int col) { return P + (col / GP_COLS) * panel_elems + (col % GP_COLS) * 2; };
    // Rows in chunks whose x stays in L2 (~1 MB) while the thread's units pass over it: at
    // 2,048 rows x 768 the whole x (3 MB) came from L3 again for every unit.
    const int chunk = std::max(mstep, static_cast<int>((1 << 20) / (static_cast<int64_t>(K) * 2) / mstep * mstep));
    const int blocks = (std::min(M, chunk) + mstep - 1) / mstep;  // row blocks in the first chunk
    const bool defer = nt == 2 && M <= DEFER_MAX_ROWS;
#pragma omp parallel
    {
        // Two accumulator buffers: a unit's epilogue runs in slices during the next unit's
        // tile products (amx_unit's during), from the buffer that unit does not write.
        alignas(64) float cbs[2][32 * 64];
        int cur = 0;
        struct Pending {
            const float* cb;
            int n0, m0, rows;
        } pend{nullptr, 0, 0, 0};
        int cfg = -1;  // the loaded configuration: r0 * 64 + r1
        const auto [u_begin, u_end] = thread_share(units);
        void* yt = y;
#if defined(_OPENMP)
        if constexpr (ARG) yt = static_cast<ArgRows*>(y) + omp_get_thread_num();
#endif
        auto epilogue = [&](const Pending& pd, int r0, int r1) {
            if (nt == 4)
                amx_epilogue<4, F32, ARG, GLU>(pd.cb, yt, N, bias, pd.n0, pd.m0, r0, r1);
            else
                amx_epilogue<2, F32, ARG, GLU>(pd.cb, yt, N, bias, pd.n0, pd.m0, r0, r1);
        };
        // The bytes of a y row a unit's epilogue writes: its columns (GLU: its gate columns, of
        // the N-wide SwiGLU output), none for ARG.
        const int64_t y_elem = F32 ? 4 : 2, span = ARG ? 0 : (GLU ? ucols : nt * 16) * y_elem;
        // The pending unit's rows in even slices over the k steps. At the first, all of its y
        // lines are requested for writing, so their misses overlap one another: where y is
        // not in cache, the slices' stores one by one otherwise missed in turn, beside the
        // tile loads.
        auto during = [&](int kb, int steps) {
            if (!pend.cb) return;
            if (kb == 0 && span > 0) {
                const int cols = std::min(N - pend.n0, static_cast<int>(span / y_elem));
                for (int r = 0; r < pend.rows; ++r) {
                    const char* a = static_cast<const char*>(y) + ((pend.m0 + r) * static_cast<int64_t>(N) + pend.n0) * y_elem;
                    __builtin_prefetch(a, 1, 3);
                    __builtin_prefetch(a + cols * y_elem - 1, 1, 3);
                }
            }
            epilogue(pend, kb * pend.rows / steps, (kb + 1) * pend.rows / steps);
        };
        for (int c0 = 0; c0 < M; c0 += chunk)
        for (int u = u_begin; u < u_end; ++u) {
            const int n0 = u * ucols, pc = GLU ? 2 * n0 : n0;  // pc: its first packed column
            const uint16_t* Bp = at(pc);
            for (int m0 = c0; m0 < std::min(M, c0 + chunk); m0 += mstep) {
                const int rows = std::min(M - m0, mstep);
                const int r0 = std::min(rows, 16), r1 = rows - r0;
                if (cfg != r0 * 64 + r1) {
                    amx_configure(nt, r0, r1);
                    cfg = r0 * 64 + r1;
                }
                // Past 16 rows, while on one panel the thread prefetches its next one into L2,
                // spread evenly over its passes on this one (the panel's two halves, the row
                // blocks of a chunk): the tile loads alone leave the weight's stream from memory
                // and the tile products taking turns (docs/SPEED.md, "Prefetching the next
                // panel"). In every chunk, not only the first: the later chunks' passes over the
                // weight find it gone from L2 too (docs/SPEED.md, "The next panel in every row
                // chunk"). Up to 16 rows the one pass over each panel streams it well as it is.
                const char* pf = nullptr;
                int pf_bytes = 0;
                const int panel = pc / GP_COLS;
                if (nt == 2 && (panel + 1) * upp < u_end) {
                    const int passes = upp * blocks;  // a shorter last chunk leaves the tail out
                    const int pass = (pc % GP_COLS) / (nt * 16) * blocks + (m0 - c0) / mstep;
                    pf_bytes = (4096 / passes + 63) & ~63;  // a panel has 4 KB per k step of 32
                    const int64_t off = static_cast<int64_t>(pass) * pf_bytes * (K / 32);
                    pf = reinterpret_cast<const char*>(P + (panel + 1) * panel_elems) + off;
                }
                float* cb = cbs[cur];
                // Where nothing can be pending, none rather than during: even during's one
                // check per k step slowed the small decode GEMMs (docs/SPEED.md, "Review").
                auto none = [](int, int) {};
                if (nt == 4)
                    amx_unit<4, false>(Bp, x, K, m0, cb, none);
                else if (r1 > 0)
                    defer ? amx_unit<2, true>(Bp, x, K, m0, cb, during, pf, pf_bytes) : amx_unit<2, true>(Bp, x, K, m0, cb, none, pf, pf_bytes);
                else
                    defer ? amx_unit<2, false>(Bp, x, K, m0, cb, during, pf, pf_bytes) : amx_unit<2, false>(Bp, x, K, m0, cb, none, pf, pf_bytes);
                if (!defer) {
                    // Up to 16 rows the GEMM streams its weight and the epilogue is small: it
                    // runs at once (deferring it gained nothing there). Past DEFER_MAX_ROWS
                    // likewise: there the kernel choice times AMX against oneDNN, and in the
                    // engine oneDNN wins these shapes by more than the slices' isolated timings
                    // show (docs/SPEED.md, "The AMX GEMM's epilogue behind the next unit").
                    epilogue(Pending{cb, n0, m0, rows}, 0, rows);
                } else {
                    pend = Pending{cb, n0, m0, rows};  // the slices above finished the previous one
                    cur ^= 1;
                }
            }
        }
        if (pend.cb) epilogue(pend, 0, pend.rows);
        if (cfg >= 0) _tile_release();
    }
    return 0;
}
#endif

template <bool F32>
int gemm_amx_or_pairs(const uint16_t* P, const uint16_t* x, void* y, const uint16_t* bias, int M, int N, int K) {
#if defined(ITERSERVE_AMX)
    return gemm_amx_impl<F32>(P, x, y, bias, M, N, K);
#else
    return gemm_pairs_impl<F32>(P, x, y, bias, M, N, K);
#endif
}
}  // namespace

extern "C" {
// y[M, N] = x[M, K] . W^T (+ bias), bf16 in and out (f32 accumulation, one rounding), with P =
// pack_bf16_pairs(W); K even. Returns -1 where not compiled in (no AVX512-BF16).
int gemm_pairs(const uint16_t* P, const uint16_t* x, uint16_t* y, const uint16_t* bias, int M, int N, int K) {
    return gemm_pairs_impl<false>(P, x, y, bias, M, N, K);
}
// The same, y f32: each value the bf16 one gemm_pairs stores, widened (one pass over the
// output instead of a bf16 store and a .float() copy).
int gemm_pairs_f32(const uint16_t* P, const uint16_t* x, float* y, const uint16_t* bias, int M, int N, int K) {
    return gemm_pairs_impl<true>(P, x, y, bias, M, N, K);
}

// act[M, I] = silu_mul_bf16(gemm_pairs's output, block 16) for P = pack_bf16_pairs(W [2I, K])
// with W's gate and up rows alternating in blocks of 16 (bias [2I] likewise, or null), the same
// bits, without that output ever stored (gemm_amx_swiglu's, on vdpbf16ps). -1 where it cannot
// (I not a multiple of 32, no AVX512-BF16): take gemm_pairs and silu_mul_bf16 then.
int gemm_pairs_swiglu(const uint16_t* P, const uint16_t* x, uint16_t* act, const uint16_t* bias, int M, int I, int K) {
    if (I % 32) return -1;
    return gemm_pairs_impl<false, true>(P, x, act, bias, M, 2 * I, K);
}

// Pairs12 from P = pack_bf16_pairs(W [N, K]) (K even), read in its order. pairs12_window: the
// base whose 8 high-7-bit values hold the most of W's values (the first such); pairs12_count:
// exc_start[panels + 1] gets each panel's first exception and the count (returned; -1 where
// offsets or counts would not fit) for that base; pack_pairs12 then fills blocks [panels * K / 2
// * 192] and the exceptions (exc_start as pairs12_count left it). The columns past N (zero in
// P) are zero codes, never read out.
int pairs12_window(const uint16_t* P, int N, int K) {
    const int K2 = K / 2, panels = (N + GP_COLS - 1) / GP_COLS;
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    std::vector<int64_t> hist(static_cast<size_t>(threads) * 128, 0);
#pragma omp parallel
    {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
        int64_t* h = hist.data() + static_cast<size_t>(tid) * 128;
        const auto [b, e] = thread_share(panels);
        for (int p = b; p < e; ++p) {
            const int words = 2 * std::min(GP_COLS, N - p * GP_COLS);  // a k pair's real columns
            for (int j = 0; j < K2; ++j) {
                const uint16_t* v = P + (static_cast<int64_t>(p) * K2 + j) * 2 * GP_COLS;
                for (int wd = 0; wd < words; ++wd) ++h[(v[wd] >> 8) & 127];
            }
        }
    }
    for (int t = 1; t < threads; ++t)
        for (int i = 0; i < 128; ++i) hist[i] += hist[static_cast<size_t>(t) * 128 + i];
    int best = 0;
    int64_t most = -1;
    for (int b = 0; b + 8 <= 128; ++b) {
        int64_t n = 0;
        for (int i = 0; i < 8; ++i) n += hist[b + i];
        if (n > most) most = n, best = b;
    }
    return best;
}
int64_t pairs12_count(const uint16_t* P, int N, int K, int base, int32_t* exc_start) {
    if (K % 2 || N < 1 || K < 2) return -1;
    const int K2 = K / 2, panels = (N + GP_COLS - 1) / GP_COLS;
    std::vector<int64_t> per(panels);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        const int words = 2 * std::min(GP_COLS, N - p * GP_COLS);
        int64_t n = 0;
        for (int j = 0; j < K2; ++j) {
            const uint16_t* v = P + (static_cast<int64_t>(p) * K2 + j) * 2 * GP_COLS;
            for (int wd = 0; wd < words; ++wd) n += static_cast<unsigned>(((v[wd] >> 8) & 127) - base) >= 8u;
        }
        per[p] = n;
    }
    int64_t total = 0;
    for (int p = 0; p < panels; ++p) {
        exc_start[p] = static_cast<int32_t>(std::min<int64_t>(total, INT32_MAX));
        total += per[p];
    }
    if (total > INT32_MAX || static_cast<int64_t>(panels) * K2 * 128 > UINT32_MAX) return -1;
    exc_start[panels] = static_cast<int32_t>(total);
    return total;
}
void pack_pairs12(const uint16_t* P, int N, int K, int base, const int32_t* exc_start, uint8_t* blocks, uint32_t* exc_off,
                  uint16_t* exc_val) {
    const int K2 = K / 2, panels = (N + GP_COLS - 1) / GP_COLS;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        const int words = 2 * std::min(GP_COLS, N - p * GP_COLS);
        int64_t e = exc_start[p];
        for (int j = 0; j < K2; ++j) {
            const int64_t at = static_cast<int64_t>(p) * K2 + j;
            const uint16_t* v = P + at * 2 * GP_COLS;
            uint8_t* b = blocks + at * P12_BLOCK;
            std::memset(b + 128, 0, 64);
            for (int wd = 0; wd < 2 * GP_COLS; ++wd) {  // column wd / 2, k value 2 j + wd % 2
                const unsigned d = static_cast<unsigned>(((v[wd] >> 8) & 127) - base);
                uint8_t code = 0;
                if (wd < words && d >= 8u) {
                    exc_off[e] = static_cast<uint32_t>(at * 128 + wd);
                    exc_val[e++] = v[wd];
                } else if (wd < words) {
                    code = static_cast<uint8_t>((v[wd] >> 15) << 3 | d);
                }
                b[wd] = static_cast<uint8_t>(v[wd] & 0xFF);
                // vector c = wd / 32 of the four: codes of 0 and 1 in bytes 128-159, of 2 and 3
                // in 160-191, the even vector's in the low nibble (P12Reader::load)
                const int c = wd / 32;
                b[128 + 32 * (c / 2) + wd % 32] |= static_cast<uint8_t>(code << (4 * (c % 2)));
            }
        }
    }
}

// 1 where gemm_pairs12 runs (AVX512-BF16 and AVX512-BW).
int has_pairs12() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}
// gemm_pairs' output, the same bits, for 1 to PAIRS12_MAX_ROWS rows on w = pack_pairs12(W):
// -1 for other row counts, an odd K, or where it cannot run (has_pairs12).
int gemm_pairs12(const Pairs12* w, const uint16_t* x, uint16_t* y, const uint16_t* bias, int M, int N, int K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return gemm_pairs12_impl<false, false>(w, x, y, bias, M, N, K);
#else
    (void)w; (void)x; (void)y; (void)bias; (void)M; (void)N; (void)K;
    return -1;
#endif
}
// gemm_pairs_f32's output (the LM head's logits), the same bits; -1 as gemm_pairs12.
int gemm_pairs12_f32(const Pairs12* w, const uint16_t* x, float* y, const uint16_t* bias, int M, int N, int K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return gemm_pairs12_impl<true, false>(w, x, y, bias, M, N, K);
#else
    (void)w; (void)x; (void)y; (void)bias; (void)M; (void)N; (void)K;
    return -1;
#endif
}
// gemm_pairs_swiglu's output, the same bits, on w = pack_pairs12(W [2I, K]); -1 as gemm_pairs12
// or where I is not a multiple of 32.
int gemm_pairs12_swiglu(const Pairs12* w, const uint16_t* x, uint16_t* act, const uint16_t* bias, int M, int I, int K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (I % 32) return -1;
    return gemm_pairs12_impl<false, true>(w, x, act, bias, M, 2 * I, K);
#else
    (void)w; (void)x; (void)act; (void)bias; (void)M; (void)I; (void)K;
    return -1;
#endif
}

// gemm_amx_argmax's answer on vdpbf16ps: out[M] = the argmax over columns of what gemm_pairs_f32
// would store, without storing it. -1 where it cannot (no AVX512-BF16): take gemm_pairs_f32 and
// argmax_f32 then.
int gemm_pairs_argmax(const uint16_t* P, const uint16_t* x, const uint16_t* bias, int M, int N, int K, int64_t* out) {
#if defined(__AVX512BF16__)
    return argmax_rows(M, out, [&](ArgRows* st) { return gemm_pairs_impl<true, false, true>(P, x, st, bias, M, N, K); });
#else
    (void)P; (void)x; (void)bias; (void)M; (void)N; (void)K; (void)out;
    return -1;
#endif
}

// --- The LM head's greedy argmax, screened on an int8 copy of its weight ---------------------
// At a few rows a greedy step's LM head is its largest single read (bench-134m: 49 of 219 MB)
// for one token a row. An int8 copy of the weight (a scale a column: half the bytes) gives every
// logit within a proven bound, and only the 64-column panels with a column whose upper bound
// reaches the best lower bound run on the bf16 weight, through the tile code of
// gemm_pairs_argmax: so the token is the one gemm_pairs_argmax gives, bit for bit.
// The bound, for column n with w = s q + r (q int8) and x~ = round(x / t) (int16), the integer
// sums exact (vpdpwssd):
//   |x.w - t s (x~.q)| <= |x| |r| + |x - t x~| s |q|   (Cauchy-Schwarz, twice)
// plus the bf16 GEMM's own rounding (at most K 2^-24 |x| |w| for its K / 2 two-product steps),
// the f32 scaling's, and 2^-100 for the products and partial sums vdpbf16ps flushes to zero
// (at most 2 K 2^-126); and since the argmax compares bf16-rounded values, a column within one
// bf16 ulp below the best lower bound is a candidate too. vdpbf16ps also reads denormal inputs
// as zero, so the screen quantizes what it multiplies (denormals as zero), and it runs only
// where |x| max|w| lies in [2^-90, 2^120], so that nothing in it or in the GEMM overflows.
constexpr int SCREEN_MAX_ROWS = 4;
constexpr int SCREEN_COLS = 64;  // a pair panel's columns (GP_COLS)

// A bf16 value as vdpbf16ps takes it: a denormal reads as zero (of its sign).
inline float bf16_daz(uint16_t v) { return (v & 0x7f80) == 0 ? 0.f : bf16_to_f32(v); }
// v as f32, rounded up (bounds).
inline float f32_up(double v) { return std::nextafter(static_cast<float>(v), INFINITY); }

// W [N, K] bf16 -> Q: the int8 panels ([ceil(N / 64)][ceil(K / 2)][64][2], zero padded) and
// coef [3 N + 1] f32: each column's scale s, |r| + (K + 8) 2^-24 |w|, and s |q|, rounded up,
// then the largest |w|. -1 (nothing usable) if W holds a NaN or an infinity.
int pack_lm_screen(const uint16_t* W, int N, int K, int8_t* Q, float* coef) {
    const int K2 = (K + 1) / 2, panels = (N + SCREEN_COLS - 1) / SCREEN_COLS;
    int bad = 0;
    double wmax = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) reduction(max : wmax)
    for (int p = 0; p < panels; ++p)
        for (int col = 0; col < SCREEN_COLS; ++col) {
            const int n = p * SCREEN_COLS + col;
            int8_t* qc = Q + static_cast<int64_t>(p) * K2 * 2 * SCREEN_COLS + 2 * col;  // (j, u) at qc[j * 128 + u]
            if (n >= N) {
                for (int j = 0; j < K2; ++j) qc[j * 2 * SCREEN_COLS] = qc[j * 2 * SCREEN_COLS + 1] = 0;
                continue;
            }
            const uint16_t* w = W + static_cast<int64_t>(n) * K;
            double amax = 0;
            for (int k = 0; k < K; ++k) {
                const float v = bf16_daz(w[k]);
                if (!std::isfinite(v)) bad = 1;
                amax = std::fmax(amax, std::fabs(static_cast<double>(v)));
            }
            const float s = static_cast<float>(amax / 127.0);
            double rr = 0, qq = 0, ww = 0;
            for (int k = 0; k < 2 * K2; ++k) {
                const double v = k < K ? static_cast<double>(bf16_daz(w[k])) : 0.0;
                const int q = s > 0 ? static_cast<int>(std::fmax(-127.0, std::fmin(127.0, std::nearbyint(v / s)))) : 0;
                qc[(k / 2) * 2 * SCREEN_COLS + k % 2] = static_cast<int8_t>(q);
                const double r = v - static_cast<double>(s) * q;
                rr += r * r;
                qq += static_cast<double>(q) * q;
                ww += v * v;
            }
            const double up = 1 + 1e-12;  // the double sums' roundings
            coef[n] = s;
            coef[N + n] = f32_up((std::sqrt(rr) + std::sqrt(ww) * (K + 8) * 0x1p-24) * up);
            coef[2 * static_cast<int64_t>(N) + n] = f32_up(static_cast<double>(s) * std::sqrt(qq) * up);
            wmax = std::fmax(wmax, std::sqrt(ww) * up);
        }
    coef[3 * static_cast<int64_t>(N)] = f32_up(wmax);
    return bad ? -1 : 0;
}

// gemm_pairs_argmax(P, x, no bias, M, N, K, out) for M <= SCREEN_MAX_ROWS, K even (x padded as
// for the pairs), with (Q, coef) = pack_lm_screen of the same weight. Returns the number of
// panels run on the bf16 weight, or -1 where it cannot run (more rows, K odd or above ~264k, a
// build without AVX512-BF16 and VNNI, a row of x not finite, or |x| max|w| outside [2^-90,
// 2^120]: all zero, say): take gemm_pairs_argmax then.
int gemm_screen_argmax(const uint16_t* P, const int8_t* Q, const float* coef, const uint16_t* x, int M, int N, int K, int64_t* out) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (M < 1 || M > SCREEN_MAX_ROWS || K < 2 || K % 2 || N < 1) return -1;
    const int K2 = K / 2, panels = (N + SCREEN_COLS - 1) / SCREEN_COLS;
    // |x~| <= xmax keeps every int32 lane's sum of K products with |q| <= 127 exact
    const int64_t lim = static_cast<int64_t>(INT32_MAX) / (127 * static_cast<int64_t>(K));
    const int xmax = static_cast<int>(std::min<int64_t>(32767, lim));
    if (xmax < 64) return -1;
    static thread_local std::vector<int32_t> xq;
    // each panel's highest upper bound, per row ([M][panels]): a panel is run on the bf16
    // weight where it reaches the row's best lower bound, known only once every panel is seen
    static thread_local std::vector<float> panel_hi;
    xq.resize(static_cast<size_t>(M) * K2);
    panel_hi.resize(static_cast<size_t>(M) * panels);
    float tr[SCREEN_MAX_ROWS], xn[SCREEN_MAX_ROWS], dxn[SCREEN_MAX_ROWS];
    const double wmax = coef[3 * static_cast<int64_t>(N)];
    for (int r = 0; r < M; ++r) {
        const uint16_t* xr = x + static_cast<int64_t>(r) * K;
        float amax = 0;
        for (int k = 0; k < K; ++k) {
            const float v = bf16_daz(xr[k]);
            if (!std::isfinite(v)) return -1;
            amax = std::fmax(amax, std::fabs(v));
        }
        if (amax == 0) return -1;
        const float t = amax / static_cast<float>(xmax);
        double xx = 0, dd = 0;
        for (int j = 0; j < K2; ++j) {
            int32_t pair = 0;
            for (int u = 0; u < 2; ++u) {
                const double v = bf16_daz(xr[2 * j + u]);
                const double a = std::fmax(-xmax, std::fmin(xmax, std::nearbyint(v / t)));
                pair |= static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(a))) << (16 * u));
                xx += v * v;
                dd += (v - static_cast<double>(t) * a) * (v - static_cast<double>(t) * a);
            }
            xq[static_cast<size_t>(r) * K2 + j] = pair;
        }
        tr[r] = t;
        const double norm = std::sqrt(xx) * (1 + 1e-12);
        if (!(norm * wmax >= 0x1p-90 && norm * wmax <= 0x1p120)) return -1;
        xn[r] = f32_up(norm);
        dxn[r] = f32_up(std::sqrt(dd) * (1 + 1e-12));
    }
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    std::vector<float> lows(static_cast<size_t>(threads) * SCREEN_MAX_ROWS, -INFINITY);
    const int32_t* xqd = xq.data();
    float* const ph = panel_hi.data();
    int ran = 0;  // candidate panels (every thread counts them all)
    const int rc = argmax_rows(M, out, [&](ArgRows* st) {
#pragma omp parallel
        {
            int tid = 0, nth = 1;
#if defined(_OPENMP)
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            const auto [pb, pe] = thread_share(panels);
            float lo[SCREEN_MAX_ROWS];
            for (int r = 0; r < M; ++r) lo[r] = -INFINITY;
            const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            for (int p = pb; p < pe; ++p) {
                __m512i acc[SCREEN_MAX_ROWS][4];
                for (int r = 0; r < M; ++r)
                    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
                const int8_t* qp = Q + static_cast<int64_t>(p) * K2 * 2 * SCREEN_COLS;
                for (int j = 0; j < K2; ++j, qp += 2 * SCREEN_COLS) {
                    __m512i w[4];
                    for (int c = 0; c < 4; ++c) w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + 32 * c)));
                    for (int r = 0; r < M; ++r) {
                        const __m512i xb = _mm512_set1_epi32(xqd[static_cast<size_t>(r) * K2 + j]);
                        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], xb, w[c]);
                    }
                }
                __m512 hi[SCREEN_MAX_ROWS], lw[SCREEN_MAX_ROWS];
                for (int r = 0; r < M; ++r) hi[r] = lw[r] = ninf;
                for (int c = 0; c < 4; ++c) {
                    const int col = p * SCREEN_COLS + 16 * c;
                    const __mmask16 mk = _mm512_cmplt_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(col), lanes), _mm512_set1_epi32(N));
                    if (!mk) break;
                    const __m512 s = _mm512_maskz_loadu_ps(mk, coef + col);
                    const __m512 A = _mm512_maskz_loadu_ps(mk, coef + N + col);
                    const __m512 B = _mm512_maskz_loadu_ps(mk, coef + 2 * static_cast<int64_t>(N) + col);
                    for (int r = 0; r < M; ++r) {
                        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_mul_ps(s, _mm512_set1_ps(tr[r])));
                        // + |a| 2^-20: the conversion's and the two products' roundings
                        const __m512 e = _mm512_fmadd_ps(A, _mm512_set1_ps(xn[r]),
                                                         _mm512_fmadd_ps(B, _mm512_set1_ps(dxn[r]), _mm512_mul_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-20f))));
                        hi[r] = _mm512_mask_max_ps(hi[r], mk, hi[r], _mm512_add_ps(a, e));
                        lw[r] = _mm512_mask_max_ps(lw[r], mk, lw[r], _mm512_sub_ps(a, e));
                    }
                }
                for (int r = 0; r < M; ++r) {
                    ph[static_cast<size_t>(r) * panels + p] = _mm512_reduce_max_ps(hi[r]);
                    lo[r] = std::fmax(lo[r], _mm512_reduce_max_ps(lw[r]));
                }
            }
            for (int r = 0; r < M; ++r) lows[static_cast<size_t>(tid) * SCREEN_MAX_ROWS + r] = lo[r];
#pragma omp barrier
            float floor_r[SCREEN_MAX_ROWS];
            for (int r = 0; r < M; ++r) {
                float L = -INFINITY;
                for (int t = 0; t < nth; ++t) L = std::fmax(L, lows[static_cast<size_t>(t) * SCREEN_MAX_ROWS + r]);
                // a column below L by less than one bf16 ulp of it may round to the same value
                floor_r[r] = L - std::fabs(L) * 0x1p-7f - 0x1p-100f;
            }
            // the candidate panels, dealt out in turn, each thread's in increasing order (ArgRows
            // keeps the first column of equal values)
            int seen = 0;
            for (int p = 0; p < panels; ++p) {
                bool cand = false;
                for (int r = 0; r < M; ++r) cand = cand || ph[static_cast<size_t>(r) * panels + p] >= floor_r[r];
                if (!cand || seen++ % nth != tid) continue;
                const uint16_t* Pp = P + static_cast<int64_t>(p) * K2 * GP_COLS * 2;
                const int n0 = p * GP_COLS;
                switch (M) {
                    case 1: pair_tile<1, 0, false, false, true>(Pp, x, K, nullptr, &st[tid], 0, N, K2, n0, 0); break;
                    case 2: pair_tile<2, 0, false, false, true>(Pp, x, K, nullptr, &st[tid], 0, N, K2, n0, 0); break;
                    case 3: pair_tile<3, 0, false, false, true>(Pp, x, K, nullptr, &st[tid], 0, N, K2, n0, 0); break;
                    default: pair_tile<4, 0, false, false, true>(Pp, x, K, nullptr, &st[tid], 0, N, K2, n0, 0); break;
                }
            }
            if (tid == 0) ran = seen;
        }
        return 0;
    });
    return rc != 0 ? -1 : ran;
#else
    (void)P; (void)Q; (void)coef; (void)x; (void)M; (void)N; (void)K; (void)out;
    return -1;
#endif
}

// 1 where gemm_screen_argmax runs (AVX512-BF16 and VNNI).
int has_lm_screen() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

// 1 where gemm_amx runs on AMX tiles: compiled for them, and the kernel let this process use
// them.
int has_amx() {
#if defined(ITERSERVE_AMX)
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}
// gemm_pairs on AMX tiles (the same packed weight, the same one rounding; the sums run in
// another order). K not a multiple of 32, or no AMX: gemm_pairs itself. -1 as gemm_pairs.
int gemm_amx(const uint16_t* P, const uint16_t* x, uint16_t* y, const uint16_t* bias, int M, int N, int K) {
    return gemm_amx_or_pairs<false>(P, x, y, bias, M, N, K);
}
int gemm_amx_f32(const uint16_t* P, const uint16_t* x, float* y, const uint16_t* bias, int M, int N, int K) {
    return gemm_amx_or_pairs<true>(P, x, y, bias, M, N, K);
}
// act[M, I] = silu_mul_bf16(gemm_amx's output, block 16) for P = pack_bf16_pairs(W [2I, K]) with
// W's gate and up rows alternating in blocks of 16 (bias [2I] likewise, or null), the same bits,
// without that output ever stored. -1 where it cannot (I not a multiple of 32, K not one of 32,
// no AMX): take gemm_amx and silu_mul_bf16 then.
int gemm_amx_swiglu(const uint16_t* P, const uint16_t* x, uint16_t* act, const uint16_t* bias, int M, int I, int K) {
#if defined(ITERSERVE_AMX)
    if (I % 32) return -1;
    return gemm_amx_impl<false, false, true>(P, x, act, bias, M, I, K);
#else
    (void)P; (void)x; (void)act; (void)bias; (void)M; (void)I; (void)K;
    return -1;
#endif
}

// out[M] = argmax over columns of what gemm_amx_f32 would store in y (argmax_f32's answer:
// the first index of the maximum, a NaN the largest), without storing y: for greedy sampling
// the LM head's f32 logits (16 MB at 128 rows x 32k) are written and read back for nothing.
// -1 where the tiles cannot run it (K not a multiple of 32, no AMX): take gemm_amx_f32 and
// argmax_f32 then.
int gemm_amx_argmax(const uint16_t* P, const uint16_t* x, const uint16_t* bias, int M, int N, int K, int64_t* out) {
#if defined(ITERSERVE_AMX)
    return argmax_rows(M, out, [&](ArgRows* st) { return gemm_amx_impl<true, true>(P, x, st, bias, M, N, K); });
#else
    (void)P; (void)x; (void)bias; (void)M; (void)N; (void)K; (void)out;
    return -1;
#endif
}

// One decoder layer of a decode-only bf16 step, the same kernel calls in the same order as
// llama.py's DecoderLayer.forward takes them when every GEMM of the layer is a pair GEMM (so
// the results are the same bits): at 1-8 rows the ~10 Python calls per layer cost as much as
// their kernels do. Per layer and constant: DecodeLayerW; per step: DecodeStep (both mirrored
// by ctypes structures in kernels.py, field for field).
struct DecodeLayerW {
    const uint16_t *in_norm, *post_norm, *qkv, *qkv_b, *o, *o_b, *gate_up, *gate_up_b, *down, *down_b;
    int hidden, n_qkv, inter, heads, kv_heads, head_dim;
    float eps, scale;
    int panels;  // 1: the four weights are f32-panel packed (pack_bf16_panels), 0: pair packed
    int amx;     // pair packed: bit i set runs GEMM i (qkv, o, gate_up, down) on gemm_amx;
                 // bit 4: gate_up and SwiGLU in one call, gemm_amx_swiglu where bit 2 is set,
                 // else gemm_pairs_swiglu (fused_decode.py)
    const uint16_t* qk_norm;  // null, or Qwen3's per-head q / k RMSNorm weight [heads + kv_heads, head_dim]
    int glu_block;            // gate_up's layout: silu_mul_bf16's block (16 for the SwiGLU epilogues)
    // per GEMM (qkv, o, gate_up, down): null, or its weight in 12 bits, which the dot-product
    // pair GEMM reads instead at up to PAIRS12_MAX_ROWS rows (the same bits)
    const Pairs12* p12[4];
};
struct DecodeStep {
    const uint16_t *cos, *sin;  // [M, hd]
    const int64_t *slots, *block_tables, *ctx_lens, *starts;  // [M], [M, max_blocks], [M], [M]
    int rows, max_blocks, block_size;
    int ahead;  // decode attention's prefetch (paged_decode_attention's `ahead`)
};

// h [M, hidden] (h += pending in place first, unless pending is null: the first layer);
// work: decode_layer_work(w, M) bf16; out [M, hidden]: this layer's MLP output (the next
// layer's pending). 0, or -1 for pair-packed weights in a build without AVX512-BF16.
int decode_layer(const DecodeLayerW* w, const DecodeStep* s, uint16_t* h, const uint16_t* pending, uint16_t* k_cache, uint16_t* v_cache,
                 uint16_t* work, uint16_t* out) {
#if !defined(__AVX512BF16__)
    if (!w->panels) return -1;
#endif
    const int M = s->rows, hid = w->hidden, hd = w->head_dim, H = w->heads, KvH = w->kv_heads;
    const int nqk = (H + KvH) * hd, q_size = H * hd, kv_size = KvH * hd;
    // y [M, N] = x [M, K] . W^T + b, bf16, on the GEMM the layer was packed for
    auto gemm = [&](int i, const uint16_t* W, const uint16_t* x, uint16_t* y, const uint16_t* b, int N, int K) {
        if (w->panels) {
            gemm_panels(W, x, y, b, 0, M, N, K);
            return;
        }
#if defined(__AVX512BF16__)
        if (w->amx >> i & 1)
            gemm_amx(W, x, y, b, M, N, K);
        else if (!w->p12[i] || gemm_pairs12(w->p12[i], x, y, b, M, N, K) != 0)
            gemm_pairs(W, x, y, b, M, N, K);
#else
        (void)i;
#endif
    };
    uint16_t* normed = work;
    uint16_t* qkv = normed + static_cast<int64_t>(M) * hid;
    uint16_t* qk = qkv + static_cast<int64_t>(M) * w->n_qkv;
    uint16_t* attn = qk + static_cast<int64_t>(M) * nqk;
    uint16_t* o = attn + static_cast<int64_t>(M) * q_size;
    uint16_t* gu = o + static_cast<int64_t>(M) * hid;
    uint16_t* act = gu + static_cast<int64_t>(M) * 2 * w->inter;
    rms_norm_bf16(h, pending, w->in_norm, normed, M, hid, w->eps);
    gemm(0, w->qkv, normed, qkv, w->qkv_b, w->n_qkv, hid);
    rope_bf16(qkv, w->n_qkv, s->cos, s->sin, qk, M, H + KvH, hd, w->qk_norm, w->eps);  // q and k together
    write_rows(qk + q_size, int64_t(nqk) * 2, k_cache, s->slots, M, int64_t(kv_size) * 2);
    write_rows(qkv + q_size + kv_size, int64_t(w->n_qkv) * 2, v_cache, s->slots, M, int64_t(kv_size) * 2);
    // the o projection's weight prefetched during attention where gemm_pairs runs it (its
    // panels split as decode_attention splits them), at one row: at 2, 4 and 8 the prefetches
    // slowed attention by as much as they saved or more (docs/SPEED.md, "Zen 4, a fifteenth
    // session")
    const bool pairs_o = !w->panels && !(w->amx >> 1 & 1) && M <= SIDE_PREFETCH_ROWS;
    const bool o12 = w->p12[1] && M <= PAIRS12_MAX_ROWS && q_size % 2 == 0 && has_pairs12();
    const void* side = !pairs_o ? nullptr : o12 ? static_cast<const void*>(w->p12[1]->blocks) : w->o;
    const int64_t side_bytes = static_cast<int64_t>(q_size / 2) * (o12 ? P12_BLOCK : GP_COLS * 4);
    decode_attention(qk, nqk, 0, k_cache, v_cache, 0, s->block_tables, s->ctx_lens, s->starts, attn, M, H, KvH, hd, s->block_size,
                     s->max_blocks, w->scale, s->ahead, side, hid, side_bytes);
    gemm(1, w->o, attn, o, w->o_b, hid, q_size);
    rms_norm_bf16(h, o, w->post_norm, normed, M, hid, w->eps);
    // the same bits either way (gemm_amx_swiglu, gemm_pairs_swiglu)
    if (!(w->amx >> 4 & 1) ||
        (w->amx >> 2 & 1 ? gemm_amx_swiglu(w->gate_up, normed, act, w->gate_up_b, M, w->inter, hid)
         : w->p12[2] && gemm_pairs12_swiglu(w->p12[2], normed, act, w->gate_up_b, M, w->inter, hid) == 0
             ? 0
             : gemm_pairs_swiglu(w->gate_up, normed, act, w->gate_up_b, M, w->inter, hid)) != 0) {
        gemm(2, w->gate_up, normed, gu, w->gate_up_b, 2 * w->inter, hid);
        silu_mul_bf16(gu, act, M, w->inter, w->glu_block);
    }
    gemm(3, w->down, act, out, w->down_b, hid, w->inter);
    return 0;
}

// decode_layer over n layers in turn (each layer's MLP output the next one's pending, the first
// with none): one call a step, not one a layer (a ctypes call costs microseconds of Python).
int decode_layers(const DecodeLayerW* ws, int n, const DecodeStep* s, uint16_t* h, uint16_t* const* k_caches, uint16_t* const* v_caches,
                  uint16_t* work, uint16_t* out) {
    for (int i = 0; i < n; ++i) {
        const int rc = decode_layer(ws + i, s, h, i == 0 ? nullptr : out, k_caches[i], v_caches[i], work, out);
        if (rc != 0) return rc;
    }
    return 0;
}

}  // extern "C"
