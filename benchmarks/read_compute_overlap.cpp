// How much of a streaming read a core hides behind arithmetic on this CPU (docs/SPEED.md,
// "How much of its reads decode attention can hide"): the read pattern of decode attention at
// B = 128 (one layer: 128 sequences x 272 positions of 1,536-byte rows, in 16-position blocks
// scattered over a pool three times the size needed; 12 layers' worth of such sets, a 64 MB
// read before each round), every 64-byte line followed by C independent FMAs, software
// prefetch D positions ahead (D < 0: into L2, as the kernel's cpu_l2 path; 0: none). Printed:
// the cold time a layer, the same loop's time on 4 sequences that stay in L2 scaled to 128
// ("hot": the arithmetic alone), and the difference, the part of the reads not hidden. Build
// and run from the repository root:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/read_compute_overlap.cpp -o /tmp/rco
//   OMP_NUM_THREADS=2 /tmp/rco -8 2 4 8 16       # D, then the values of C
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static char* huge(size_t n) {
    const size_t sz = (n + (2 << 20)) & ~size_t((2 << 20) - 1);
    void* p = mmap(nullptr, sz + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char* a = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
    madvise(a, sz, MADV_HUGEPAGE);
    memset(a, 1, sz);
    return a;
}

constexpr int BS = 16, ROW = 1536, CTX = 272;

template <int C>
static float stream(const char* cache, const int64_t* bt, int B, int per, int dist, bool to_l2) {
    float tot = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : tot)
    for (int d = 0; d < B; ++d) {
        __m512 acc[8];
        for (auto& a : acc) a = _mm512_setzero_ps();
        const __m512 w = _mm512_set1_ps(1.0001f);
        for (int p = 0; p < CTX; ++p) {
            if (dist && p + dist < CTX) {
                const char* a = cache + (bt[d * per + (p + dist) / BS] * BS + (p + dist) % BS) * int64_t(ROW);
                for (int o = 0; o < ROW; o += 64) {
                    if (to_l2)
                        _mm_prefetch(a + o, _MM_HINT_T1);
                    else
                        _mm_prefetch(a + o, _MM_HINT_T0);
                }
            }
            const char* r = cache + (bt[d * per + p / BS] * BS + p % BS) * int64_t(ROW);
            for (int i = 0; i < ROW / 64; ++i) {
                const __m512 v = _mm512_castsi512_ps(_mm512_loadu_si512(r + 64 * i));
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) acc[(i + c) & 7] = _mm512_fmadd_ps(v, w, acc[(i + c) & 7]);
            }
        }
        __m512 s = acc[0];
        for (int j = 1; j < 8; ++j) s = _mm512_add_ps(s, acc[j]);
        tot += _mm512_reduce_add_ps(s);
    }
    return tot;
}

static float run(int C, const char* cache, const int64_t* bt, int B, int per, int dist, bool to_l2) {
    switch (C) {
        case 1: return stream<1>(cache, bt, B, per, dist, to_l2);
        case 2: return stream<2>(cache, bt, B, per, dist, to_l2);
        case 4: return stream<4>(cache, bt, B, per, dist, to_l2);
        case 8: return stream<8>(cache, bt, B, per, dist, to_l2);
        case 16: return stream<16>(cache, bt, B, per, dist, to_l2);
        default: std::fprintf(stderr, "C must be 1, 2, 4, 8 or 16\n"); std::exit(2);
    }
}

int main(int argc, char** argv) {
    if (argc < 3) {
        std::printf("usage: %s D C [C ...]\n", argv[0]);
        return 2;
    }
    const int B = 128, per = (CTX + BS - 1) / BS, sets = 12, nb = 3 * sets * B * per;
    const int D = std::atoi(argv[1]);
    char* cache = huge(size_t(nb) * BS * ROW);
    std::vector<int64_t> perm(nb);
    for (int i = 0; i < nb; ++i) perm[i] = i;
    std::mt19937 g(0);
    std::shuffle(perm.begin(), perm.end(), g);
    std::vector<char> flush(64 << 20, 1);
    const double mb = double(B) * CTX * ROW / 1e6;
    for (int ci = 2; ci < argc; ++ci) {
        const int C = std::atoi(argv[ci]);
        std::vector<double> cold, hot;
        for (int it = 0; it < 6; ++it) {
            volatile int64_t s = 0;
            for (size_t i = 0; i < flush.size(); i += 64) s += flush[i];
            for (int t = 0; t < sets; ++t) {
                const double t0 = now();
                volatile float r = run(C, cache, perm.data() + size_t(t) * B * per, B, per, D < 0 ? -D : D, D < 0);
                (void)r;
                cold.push_back(now() - t0);
            }
        }
        for (int it = 0; it < 30; ++it) {
            const double t0 = now();
            volatile float r = run(C, cache, perm.data(), 4, per, D < 0 ? -D : D, D < 0);
            (void)r;
            hot.push_back((now() - t0) * B / 4);
        }
        std::sort(cold.begin(), cold.end());
        std::sort(hot.begin(), hot.end());
        const double c = cold[cold.size() / 2], h = hot[hot.size() / 2];
        std::printf("D=%d C=%d: cold %.2f ms a layer (%.1f GB/s), hot %.2f ms, not hidden %.2f ms\n", D, C, c * 1e3, mb / c / 1e3, h * 1e3,
                    (c - h) * 1e3);
    }
    return 0;
}
