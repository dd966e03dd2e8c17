// The small-batch bf16 GEMM in dot-product form on AVX2 (docs/SPEED.md, "Zen 3, a fourth
// session"): the 49 bench-134m weights kept row-major ([N, K] bf16, as loaded), every row of x
// against one weight row in a single pass (the panel kernel makes one pass from memory and up to
// three from L2 at 4-16 rows). A 32-byte run of a weight row widens into its even and odd
// elements with one op each; x is stored de-interleaved the same way, so each x row takes two
// FMAs (full-vector memory operands) a run and one accumulator. Variant 3: every row in tiles
// of 8 while the weight row sits in L1; variant 2: two weight rows at once (1-4 x rows).
// Prints the median and best of 15 sets, ms; compare with `python benchmarks/kernels.py gemm
// --rows M` (the panels column) in the same minutes. Build and run from the repository root:
//
//   g++ -O3 -mavx2 -mfma -fopenmp -std=c++17 benchmarks/avx2_dot_gemm.cpp -o /tmp/dot
//   OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE /tmp/dot 8 3     # M rows, variant
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

static float bf(uint16_t v) {
    const uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

// x rows [m0, m0 + MB) against weight row n; xd [M][K] holds each 16-run as [8 even][8 odd].
template <int MB>
static inline void tile1(const uint16_t* Wn, const float* xd, float* y, int N, int K, int n, int m0) {
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    __m256 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Wn + k));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
            const float* xr = xd + int64_t(m0 + i) * K + k;
            acc[i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), acc[i]);
            acc[i] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 8), acc[i]);
        }
    }
    for (int i = 0; i < MB; ++i) y[int64_t(m0 + i) * N + n] = hsum(acc[i]);
}

static void rows_tiled(const uint16_t* W, const float* xd, float* y, int N, int K, int n0, int n1, int M) {
    for (int n = n0; n < n1; ++n) {
        const uint16_t* Wn = W + int64_t(n) * K;
        int m0 = 0;
        for (; M - m0 >= 8; m0 += 8) tile1<8>(Wn, xd, y, N, K, n, m0);
        switch (M - m0) {
            case 7: tile1<7>(Wn, xd, y, N, K, n, m0); break;
            case 6: tile1<6>(Wn, xd, y, N, K, n, m0); break;
            case 5: tile1<5>(Wn, xd, y, N, K, n, m0); break;
            case 4: tile1<4>(Wn, xd, y, N, K, n, m0); break;
            case 3: tile1<3>(Wn, xd, y, N, K, n, m0); break;
            case 2: tile1<2>(Wn, xd, y, N, K, n, m0); break;
            case 1: tile1<1>(Wn, xd, y, N, K, n, m0); break;
            default: break;
        }
    }
}

// Two weight rows at once against MB x rows (2 MB accumulators).
template <int MB>
static void rows_pair(const uint16_t* W, const float* xd, float* y, int N, int K, int n0, int n1, int) {
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int n = n0; n < n1; n += 2) {
        const uint16_t* Wa = W + int64_t(n) * K;
        const uint16_t* Wb = Wa + K;
        __m256 a[MB], b[MB];
        for (int i = 0; i < MB; ++i) a[i] = b[i] = _mm256_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Wa + k));
            const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Wb + k));
            const __m256 alo = _mm256_castsi256_ps(_mm256_slli_epi32(va, 16));
            const __m256 ahi = _mm256_castsi256_ps(_mm256_and_si256(va, mask));
            const __m256 blo = _mm256_castsi256_ps(_mm256_slli_epi32(vb, 16));
            const __m256 bhi = _mm256_castsi256_ps(_mm256_and_si256(vb, mask));
#pragma GCC unroll 16
            for (int i = 0; i < MB; ++i) {
                const float* xr = xd + int64_t(i) * K + k;
                const __m256 xe = _mm256_loadu_ps(xr), xo = _mm256_loadu_ps(xr + 8);
                a[i] = _mm256_fmadd_ps(alo, xe, a[i]);
                a[i] = _mm256_fmadd_ps(ahi, xo, a[i]);
                b[i] = _mm256_fmadd_ps(blo, xe, b[i]);
                b[i] = _mm256_fmadd_ps(bhi, xo, b[i]);
            }
        }
        for (int i = 0; i < MB; ++i) {
            y[int64_t(i) * N + n] = hsum(a[i]);
            y[int64_t(i) * N + n + 1] = hsum(b[i]);
        }
    }
}

using Fn = void (*)(const uint16_t*, const float*, float*, int, int, int, int, int);

static void gemm(Fn f, int step, const uint16_t* W, const float* xd, float* y, int M, int N, int K) {
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int per = (N / step + T - 1) / T * step;
        const int n0 = t * per, n1 = std::min(N, n0 + per);
        if (n0 < n1) f(W, xd, y, N, K, n0, n1, M);
    }
}

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s M variant (3: tiles of 8 rows, any M; 2: two weight rows, M <= 4)\n", argv[0]);
        return 2;
    }
    const int M = std::atoi(argv[1]), variant = std::atoi(argv[2]);
    Fn f = rows_tiled;
    int step = 1;
    if (variant == 2) {
        step = 2;
        f = M == 1 ? rows_pair<1> : M == 2 ? rows_pair<2> : M == 3 ? rows_pair<3> : M == 4 ? rows_pair<4> : nullptr;
        if (!f) {
            std::fprintf(stderr, "variant 2 takes M <= 4\n");
            return 2;
        }
    }
    std::vector<std::pair<int, int>> shapes;  // [N, K]: q/k/v fused, o, gate/up fused, down; the LM head
    for (int l = 0; l < 12; ++l) shapes.insert(shapes.end(), {{2304, 768}, {768, 768}, {4096, 768}, {768, 2048}});
    shapes.push_back({32000, 768});
    std::vector<std::vector<uint16_t>> Ws;
    for (auto& s : shapes) {
        std::vector<uint16_t> w(size_t(s.first) * s.second);
        for (auto& v : w) v = static_cast<uint16_t>(0x3c00 + (std::rand() & 0xff));
        Ws.push_back(std::move(w));
    }
    std::vector<float> x768(size_t(M) * 768), x2048(size_t(M) * 2048), y(size_t(M) * 32000);
    for (auto& v : x768) v = (std::rand() % 100) / 100.f;
    for (auto& v : x2048) v = (std::rand() % 100) / 100.f;
    {  // one GEMM against a scalar reference (xd's even half multiplies the even elements)
        const int N = 768, K = 768;
        gemm(f, step, Ws[1].data(), x768.data(), y.data(), M, N, K);
        double err = 0;
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < 8; ++n) {
                double r = 0;
                for (int b = 0; b < K; b += 16)
                    for (int i = 0; i < 8; ++i)
                        r += double(bf(Ws[1][size_t(n) * K + b + 2 * i])) * x768[size_t(m) * K + b + i] +
                             double(bf(Ws[1][size_t(n) * K + b + 2 * i + 1])) * x768[size_t(m) * K + b + 8 + i];
                err = std::max(err, std::fabs(r - y[size_t(m) * N + n]) / (1e-6 + std::fabs(r)));
            }
        std::printf("max relative error against the scalar sum: %.1e\n", err);
    }
    std::vector<double> ts;
    for (int rep = 0; rep < 15; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (size_t i = 0; i < shapes.size(); ++i)
            gemm(f, step, Ws[i].data(), shapes[i].second == 768 ? x768.data() : x2048.data(), y.data(), M, shapes[i].first,
                 shapes[i].second);
        ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    std::printf("M=%d variant=%d: 49 GEMMs, median %.2f ms, best %.2f\n", M, variant, ts[ts.size() / 2], ts[0]);
    return 0;
}
