// Decode attention from C++ on a cache small enough to stay hot (docs/SPEED.md, "The LM head's
// argmax and gate_up's SwiGLU in the AMX epilogue"): the kernel's own cost per position and
// head, without the memory; decode_attention_reads.cpp is the cold counterpart. Includes the
// library's source (-DKERNEL='"path"' builds a copy with a change the same way). bench-134m's
// shape: 12 KV heads of 64, bf16, blocks of 16 scattered over twice the blocks needed.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/decode_attention_hot.cpp -o /tmp/dah
//   OMP_NUM_THREADS=1 /tmp/dah B CTX [AHEAD [CALLS]]   # AHEAD: the kernel's prefetch (-8: the
//                                                      # cpu_l2 path, 8: cpu, 0: cpu_nopf)
//
// B = 4, CTX = 128 is 1.6 MB of K and V (in one core's 2 MB L2 here). Prints the median us a
// call, GB/s of K and V, ns per position and head per thread, and a checksum of the output.
#ifndef KERNEL
#define KERNEL "../iterserve/model/csrc/cpu_kernels.cpp"
#endif
#include KERNEL
#include <chrono>
#include <random>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
    int B = atoi(argv[1]), ctx = atoi(argv[2]); int PFD = argc > 3 ? atoi(argv[3]) : -8; int reps = argc > 4 ? atoi(argv[4]) : 2000;
    const int H = 12, hd = 64, row = H*hd, bs = 16;
    int per = (ctx + bs - 1)/bs; int nb = 2*B*per;
    std::vector<uint16_t> k((size_t)nb*bs*row), v((size_t)nb*bs*row);
    std::mt19937 g(0);
    for (size_t i = 0; i < k.size(); ++i) { float f = ((int)(g()%2001)-1000)/1000.f; uint32_t u; memcpy(&u,&f,4); k[i]=u>>16; f = ((int)(g()%2001)-1000)/1000.f; memcpy(&u,&f,4); v[i]=u>>16; }
    std::vector<int64_t> perm(nb); for (int i=0;i<nb;++i) perm[i]=i; std::shuffle(perm.begin(), perm.end(), g);
    std::vector<int64_t> lens(B, ctx), starts(B, 0);
    std::vector<uint16_t> q(B*H*hd); for (size_t i = 0; i < q.size(); ++i) q[i] = 0x3f80 + (i % 13) - 6;
    std::vector<uint16_t> out(B*H*hd);
    std::vector<double> ts;
    for (int it = 0; it < reps; ++it) {
        double t0 = now();
        paged_decode_attention(q.data(), H*hd, 0, k.data(), v.data(), 0, perm.data(), lens.data(), starts.data(), out.data(), B, H, H, hd, bs, per, 0.125f, PFD);
        ts.push_back((now()-t0)*1e6);
    }
    std::sort(ts.begin(), ts.end());
    double med = ts[ts.size()/2];
    double mb = (double)B*ctx*row*2*2/1e6;
    double cs = 0, mx = 0; for (auto x : out) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f,&u,4); cs += f; mx = std::max(mx, (double)std::fabs(f)); } 
    printf("B=%d ctx=%d threads=%d: %.2f us/call, %.2f MB, %.1f GB/s, ns per position-head %.2f (checksum %.6f max %g)\n", B, ctx, omp_get_max_threads(), med, mb, mb/med*1e3, med*1e3*omp_get_max_threads()/(B*ctx*H), cs, mx);
}
