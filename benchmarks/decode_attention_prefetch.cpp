// Plain reads of a decode step's scattered KV rows (bench-134m: 1,536-byte rows, blocks of 16)
// under six prefetch schemes, alternated over 8 rounds in one process (docs/SPEED.md, "Where the
// time of decode attention goes"). From the repository root:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/decode_attention_prefetch.cpp -o /tmp/dap
//   OMP_NUM_THREADS=2 /tmp/dap 32 160
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <random>
#include <algorithm>
#include <vector>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <cstdint>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static void* huge(size_t n) {
    size_t sz = (n + (2<<20)) & ~size_t((2<<20)-1);
    void* p = mmap(nullptr, sz + (2<<20), PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
    char* a = (char*)(((uintptr_t)p + (2<<20)-1) & ~uintptr_t((2<<20)-1));
    madvise(a, sz, MADV_HUGEPAGE); memset(a, 1, sz); return a;
}
const int ROW = 1536, BS = 16;
// variant: 0 none, 1 t0 8 pos ahead, 2 t0 16 ahead, 3 t1 32 ahead + t0 8 ahead, 4 two seqs interleaved per task, 5 t2 48 ahead + t0 8
static int64_t readseq(const char* c, const int64_t* bt, int ctx, int var) {
    __m512i acc = _mm512_setzero_si512();
    auto addr = [&](int p) { return c + (bt[p / BS] * BS + p % BS) * (int64_t)ROW; };
    for (int p = 0; p < ctx; ++p) {
        if (var == 1 || var == 3 || var == 5) { if (p + 8 < ctx) { const char* a = addr(p + 8); for (int o = 0; o < ROW; o += 64) _mm_prefetch(a + o, _MM_HINT_T0); } }
        if (var == 2) { if (p + 16 < ctx) { const char* a = addr(p + 16); for (int o = 0; o < ROW; o += 64) _mm_prefetch(a + o, _MM_HINT_T0); } }
        if (var == 3) { if (p + 32 < ctx) { const char* a = addr(p + 32); for (int o = 0; o < ROW; o += 64) _mm_prefetch(a + o, _MM_HINT_T1); } }
        if (var == 5) { if (p + 48 < ctx) { const char* a = addr(p + 48); for (int o = 0; o < ROW; o += 64) _mm_prefetch(a + o, _MM_HINT_T2); } }
        const __m512i* r = (const __m512i*)addr(p);
        for (int i = 0; i < ROW / 64; ++i) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(r + i));
    }
    return _mm512_reduce_add_epi32(acc);
}
int main(int argc, char** argv) {
    int B = atoi(argv[1]), ctx = atoi(argv[2]);
    int per = (ctx + BS - 1) / BS, sets = 12, nb = 3 * sets * B * per;
    size_t bytes = (size_t)nb * BS * ROW;
    char* k = (char*)huge(bytes); char* v = (char*)huge(bytes);
    std::mt19937 g(0);
    std::vector<int64_t> perm(nb); for (int i = 0; i < nb; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), g);
    std::vector<char> flush(64 << 20, 1);
    const int NV = 6;
    std::vector<std::vector<double>> ts(NV);
    for (int round = 0; round < 8; ++round)
        for (int var = 0; var < NV; ++var) {
            volatile int64_t s = 0; for (size_t i = 0; i < flush.size(); i += 64) s += flush[i];
            double t0 = now();
            for (int t = 0; t < sets; ++t) {
                const int64_t* bt = perm.data() + (size_t)t * B * per;
                int64_t tot = 0;
                if (var == 4) {
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : tot)
                    for (int d = 0; d < B; d += 2) {
                        // two sequences walked in lockstep: two streams per thread
                        for (const char* c : {k, v}) {
                            __m512i acc = _mm512_setzero_si512();
                            for (int p = 0; p < ctx; ++p)
                                for (int e = d; e < d + 2 && e < B; ++e) {
                                    const __m512i* r = (const __m512i*)(c + (bt[e * per + p / BS] * BS + p % BS) * (int64_t)ROW);
                                    for (int i = 0; i < ROW / 64; ++i) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(r + i));
                                }
                            tot += _mm512_reduce_add_epi32(acc);
                        }
                    }
                } else {
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : tot)
                    for (int d = 0; d < B; ++d) tot += readseq(k, bt + d * per, ctx, var) + readseq(v, bt + d * per, ctx, var);
                }
                s += tot;
            }
            ts[var].push_back((now() - t0) * 1e6 / sets);
        }
    double mb = (double)B * ctx * ROW * 2 / 1e6;
    const char* names[] = {"no prefetch", "t0 8 ahead", "t0 16 ahead", "t0 8 + t1 32", "2 seqs lockstep", "t0 8 + t2 48"};
    for (int var = 0; var < NV; ++var) {
        auto x = ts[var]; std::sort(x.begin(), x.end()); double med = x[x.size() / 2];
        printf("%-16s %7.1f us/layer %5.1f GB/s\n", names[var], med, mb / med * 1e3);
    }
}
