// What a streaming read loses for being cut into pieces with a sync between them, as a decode
// step reads its weights (docs/SPEED.md, "Zen 4, a fifteenth session"): 219 MB (bench-134m's
// 49 matmul weights) read by all threads, each piece split between them, either as k OpenMP
// regions or as k pieces of one region with a barrier after each, and with each thread's share
// of the next piece prefetched (into L2) before the barrier, PF KB of it. Against a 1 GiB read
// in one region (the roofline's probe). GB/s, medians of 7 reads (3 for the probe), one line a
// round. Build and run from the repository root:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/read_pieces.cpp -o /tmp/read_pieces
//   OMP_NUM_THREADS=2 /tmp/read_pieces 16        # rounds
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <vector>

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

float sink[64 * 16];  // each thread's sums, a line apart: the reads cannot be optimized away

#if defined(__AVX512F__)
float read_range(const char* a, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t off = 0; off + 256 <= n; off += 256) {
        s0 = _mm512_add_ps(s0, _mm512_load_ps(reinterpret_cast<const float*>(a + off)));
        s1 = _mm512_add_ps(s1, _mm512_load_ps(reinterpret_cast<const float*>(a + off + 64)));
        s2 = _mm512_add_ps(s2, _mm512_load_ps(reinterpret_cast<const float*>(a + off + 128)));
        s3 = _mm512_add_ps(s3, _mm512_load_ps(reinterpret_cast<const float*>(a + off + 192)));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
#else
float read_range(const char* a, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t off = 0; off + 128 <= n; off += 128) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(reinterpret_cast<const float*>(a + off)));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(reinterpret_cast<const float*>(a + off + 32)));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(reinterpret_cast<const float*>(a + off + 64)));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(reinterpret_cast<const float*>(a + off + 96)));
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#endif

char* huge(int64_t n) {
    char* p = static_cast<char*>(aligned_alloc(1 << 21, n));
    madvise(p, n, MADV_HUGEPAGE);
    for (int64_t i = 0; i < n; i += 4) *reinterpret_cast<float*>(p + i) = 1.f;
    return p;
}

template <typename F>
double median_s(F&& f, int reps) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        f();
        t.push_back(now() - t0);
    }
    std::sort(t.begin(), t.end());
    return t[reps / 2];
}
}  // namespace

int main(int argc, char** argv) {
    const int64_t nb = 219LL << 20, pb = 1LL << 30;
    char* buf = huge(nb);
    char* big = huge(pb);
    const int rounds = argc > 1 ? atoi(argv[1]) : 10;
    // thread tid's share [a, a + n) of piece p of k (whole 256-byte steps)
    auto share = [&](int k, int p, int tid, int nth, int64_t& a, int64_t& n) {
        const int64_t per = nb / k / 256 * 256, h = per / nth / 256 * 256;
        a = p * per + tid * h;
        n = tid == nth - 1 ? per - tid * h : h;
    };
    auto regions = [&](int k) {
        for (int p = 0; p < k; ++p) {
#pragma omp parallel
            {
                int64_t a, n;
                share(k, p, omp_get_thread_num(), omp_get_num_threads(), a, n);
                sink[omp_get_thread_num() * 16] += read_range(buf + a, n);
            }
        }
    };
    auto barriers = [&](int k, int64_t pf) {
#pragma omp parallel
        {
            const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
            for (int p = 0; p < k; ++p) {
                int64_t a, n;
                share(k, p, tid, nth, a, n);
                sink[tid * 16] += read_range(buf + a, n);
                if (pf > 0 && p + 1 < k) {
                    share(k, p + 1, tid, nth, a, n);
                    for (int64_t off = 0; off < std::min(pf, n); off += 64) __builtin_prefetch(buf + a + off, 0, 2);
                }
#pragma omp barrier
            }
        }
    };
    printf("GB/s; regions k: k OpenMP regions; k, PF: one region, k pieces, a barrier after each, PF KB of the next prefetched\n");
    for (int r = 0; r < rounds; ++r) {
        const double probe = pb / median_s([&] {
#pragma omp parallel
            {
                const int64_t h = pb / omp_get_num_threads();
                sink[omp_get_thread_num() * 16] += read_range(big + omp_get_thread_num() * h, h);
            }
        }, 3) / 1e9;  // clang-format: keep
        printf("probe %5.1f | regions 1 %5.1f  49 %5.1f  196 %5.1f |", probe, nb / median_s([&] { regions(1); }, 7) / 1e9,
               nb / median_s([&] { regions(49); }, 7) / 1e9, nb / median_s([&] { regions(196); }, 7) / 1e9);
        for (int k : {49, 196})
            for (int64_t pf : {0, 16, 64, 256}) printf(" %d,%ld %5.1f", k, static_cast<long>(pf), nb / median_s([&] { barriers(k, pf << 10); }, 7) / 1e9);
        printf("\n");
        fflush(stdout);
    }
}
