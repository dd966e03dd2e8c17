// Decode attention's reads (docs/SPEED.md, "Where the time of decode attention goes"): the C++
// kernel against a plain read of the same cache rows, over blocks scattered in a pool three times
// the size needed or over contiguous ones, 12 layers' worth of calls after a 64 MB cache flush;
// median us a layer and GB/s of K and V read. Build and run from the repository root:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/decode_attention_reads.cpp -o /tmp/dar
//   OMP_NUM_THREADS=2 /tmp/dar B CTX MODE     # BS=64 in the environment: blocks of 64 tokens
//
// SETS=n in the environment: n layers' worth of caches instead of 12 (SETS=1 NOFLUSH=1: one
// layer's, read again and again without the flush, to see what the L3 cache keeps of it).
// MODE 0: the kernel, scattered blocks; 1: plain read, scattered (a 4th argument N: prefetch N
// positions ahead); 2: plain read, contiguous; 3: plain read, K and V block by block (N: blocks
// prefetched ahead); 4: the kernel, contiguous. For modes 0 and 4, N is the kernel's prefetch
// (default 8, the cpu path's; -8: into L2, the cpu_l2 path's; 0: the cpu_nopf path). bench-134m's shape: 12 KV heads of 64, bf16.
// Prefetch kinds and two sequences walked in lockstep: decode_attention_prefetch.cpp.
#include "../iterserve/model/csrc/cpu_kernels.cpp"
#include <sys/mman.h>
#include <chrono>
#include <random>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static void* huge(size_t n) {
    size_t sz = (n + (2<<20)) & ~size_t((2<<20)-1);
    void* p = mmap(nullptr, sz + (2<<20), PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
    char* a = (char*)(((uintptr_t)p + (2<<20)-1) & ~uintptr_t((2<<20)-1));
    madvise(a, sz, MADV_HUGEPAGE);
    memset(a, 0, sz);
    return a;
}
// pure read of the same rows: sum
static int PFD = 0, BSG = 16;  // prefetch distance (positions), block size (tokens)
static int64_t pure_read(const uint16_t* k, const uint16_t* v, const int64_t* bt, int B, int per, int ctx, int row) {
    int64_t tot = 0;
#pragma omp parallel for schedule(dynamic,1) reduction(+:tot)
    for (int d = 0; d < B; ++d) {
        __m512i acc = _mm512_setzero_si512();
        for (const uint16_t* c : {k, v}) {
            for (int p = 0; p < ctx; ++p) {
                const int64_t slot = bt[d*per + p/BSG]*BSG + p%BSG;
                if (PFD > 0 && p + PFD < ctx) { const int64_t s2 = bt[d*per + (p+PFD)/BSG]*BSG + (p+PFD)%BSG; const char* a = (const char*)(c + s2*row); for (int o = 0; o < row*2; o += 64) __builtin_prefetch(a+o, 0, 3); }
                const __m512i* r = (const __m512i*)(c + slot*row);
                for (int i = 0; i < row*2/64; ++i) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(r+i));
            }
        }
        tot += _mm512_reduce_add_epi32(acc);
    }
    return tot;
}
static int64_t read_kv_blocks(const uint16_t* k, const uint16_t* v, const int64_t* bt, int B, int per, int ctx, int row, int pfblocks) {
    int64_t tot = 0;
#pragma omp parallel for schedule(dynamic,1) reduction(+:tot)
    for (int d = 0; d < B; ++d) {
        __m512i acc = _mm512_setzero_si512();
        const int nblk = (ctx + BSG - 1) / BSG;
        for (int b = 0; b < nblk; ++b) {
            if (pfblocks > 0 && b + pfblocks < nblk) {
                for (const uint16_t* c : {k, v}) {
                    const char* a = (const char*)(c + bt[d*per + b + pfblocks]*BSG*row);
                    int npos = std::min(BSG, ctx - (b+pfblocks)*BSG);
                    for (int o = 0; o < npos*row*2; o += 64) __builtin_prefetch(a+o, 0, 3);
                }
            }
            int npos = std::min(BSG, ctx - b*BSG);
            for (const uint16_t* c : {k, v}) {
                const __m512i* r = (const __m512i*)(c + bt[d*per + b]*BSG*row);
                for (int i = 0; i < npos*row*2/64; ++i) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(r+i));
            }
        }
        tot += _mm512_reduce_add_epi32(acc);
    }
    return tot;
}
int main(int argc, char** argv) {
    int B = atoi(argv[1]), ctx = atoi(argv[2]);
    const int H = 12, hd = 64, row = H*hd;
    BSG = getenv("BS") ? atoi(getenv("BS")) : 16;
    const int bs = BSG;
    int per = (ctx + bs - 1)/bs;
    int sets = getenv("SETS") ? atoi(getenv("SETS")) : 12; int nb = 3*sets*B*per;
    size_t bytes = (size_t)nb*bs*row*2;
    uint16_t* k = (uint16_t*)huge(bytes); uint16_t* v = (uint16_t*)huge(bytes);
    std::mt19937 g(0);
    for (size_t i = 0; i < (size_t)nb*bs*row; ++i) { float f = (g()%2001-1000)/1000.f; uint32_t u; memcpy(&u,&f,4); k[i]=u>>16; f = (g()%2001-1000)/1000.f; memcpy(&u,&f,4); v[i]=u>>16; }
    std::vector<int64_t> perm(nb); for (int i=0;i<nb;++i) perm[i]=i; std::shuffle(perm.begin(), perm.end(), g);
    std::vector<int64_t> lens(B, ctx), starts(B, 0);
    std::vector<uint16_t> q(B*H*hd); for (auto& x: q) x = 0x3f80;
    std::vector<uint16_t> out(B*H*hd);
    std::vector<char> flush(64<<20, 1);
    int mode = argc > 3 ? atoi(argv[3]) : 0;
    PFD = argc > 4 ? atoi(argv[4]) : (mode == 0 || mode == 4 ? 8 : 0);
    if (mode == 2 || mode == 4) for (int i = 0; i < nb; ++i) perm[i] = i;
    std::vector<double> ts;
    for (int it = 0; it < 10; ++it) {
        volatile int64_t s = 0; if (!getenv("NOFLUSH")) for (size_t i = 0; i < flush.size(); i += 64) s += flush[i];
        for (int t = 0; t < sets; ++t) {
            const int64_t* bt = perm.data() + (size_t)t*B*per;
            double t0 = now();
            if (mode == 0 || mode == 4) paged_decode_attention(q.data(), H*hd, 0, k, v, 0, bt, lens.data(), starts.data(), out.data(), B, H, H, hd, bs, per, 0.125f, PFD);
            else if (mode == 3) { volatile int64_t r = read_kv_blocks(k, v, bt, B, per, ctx, row, PFD); (void)r; }
            else { volatile int64_t r = pure_read(k, v, bt, B, per, ctx, row); (void)r; }
            ts.push_back((now()-t0)*1e6);
        }
    }
    std::sort(ts.begin(), ts.end());
    double med = ts[ts.size()/2];
    double mb = (double)B*ctx*row*2*2/1e6;
    printf("mode %d B=%d ctx=%d: %.1f us/layer, %.1f MB, %.1f GB/s\n", mode, B, ctx, med, mb, mb/med*1e3);
}
