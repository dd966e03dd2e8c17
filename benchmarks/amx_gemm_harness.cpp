// The AMX GEMM's limits on this CPU, from C++ (docs/SPEED.md, "Prefetching the next panel").
// Includes the library's source, so a copy of it with a change builds the same way
// (-DKERNEL='"path"'). One thread unless OMP_NUM_THREADS says otherwise. Modes:
//
//   loop SA SB UNITS MISALIGN [AUNITS]
//                               the 2 x 2 tile loop alone (K = 768: 24 steps of 4 products on
//                               A tiles SA bytes a row apart and B tiles SB apart; 64 means
//                               1 KB contiguous tiles), over UNITS distinct B areas (1: all in
//                               L1; 64: in L3) and AUNITS distinct A areas (21: a 1 MB chunk
//                               of x in L2, as the GEMM's row blocks; default 1), buffers
//                               MISALIGN bytes past a 64-byte boundary
//   gemm M N K [WEIGHTS]        gemm_amx on one shape, the weight hot (1) or WEIGHTS copies cycled
//   glu M I K [WEIGHTS]         gemm_amx_swiglu on a gate and up weight [2I, K] (I % 32 == 0),
//                               likewise
//   glusep M I K [WEIGHTS]      the same as gemm_amx then silu_mul_bf16 (GLU_BLOCK's layout)
//   layers M [LAYERS]           a step's layer GEMMs back to back, every weight from memory
//
// ns per tile product (per thread), best of 7-9 rounds. Build and run from the repository root:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/amx_gemm_harness.cpp -o /tmp/amx_gemm
//   /tmp/amx_gemm loop 64 64 1 0 && /tmp/amx_gemm loop 64 64 1 16 && /tmp/amx_gemm loop 1536 256 64 0
//   /tmp/amx_gemm gemm 2048 2304 768 && OMP_NUM_THREADS=2 /tmp/amx_gemm layers 32
#ifndef KERNEL
#define KERNEL "../iterserve/model/csrc/cpu_kernels.cpp"
#endif
#include KERNEL
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(ITERSERVE_AMX)
template <typename F>
static double best_s(int rounds, int reps, F&& body) {
    double best = 1e30;
    for (int r = 0; r < rounds; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) body(i);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
        best = s < best ? s : best;
    }
    return best;
}

static char* aligned_at(std::vector<char>& v, int misalign) {
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63)) + misalign;
}

static int loop(int sa, int sb, int units, int misalign, int aunits) {
    constexpr int KB = 24;
    // A: 32 rows of K; contiguous tiles (sa = 64) take 2 KB a k step. B: per unit and k step,
    // two tiles (sb = 64: 2 KB contiguous; else 16 rows sb apart, the second tile 64 bytes on).
    const size_t a_bytes = sa == 64 ? size_t(KB) * 2048 : size_t(32) * sa + KB * 64;
    const size_t b_unit = sb == 64 ? size_t(KB) * 2048 : size_t(KB) * 16 * sb;
    std::vector<char> abuf(a_bytes * aunits + 128, 1), bbuf(b_unit * units + 128, 1);
    const char* A = aligned_at(abuf, misalign);
    const char* B = aligned_at(bbuf, misalign);
    amx_configure(2, 16, 16);
    alignas(64) static float cb[32 * 32];
    const double s = best_s(7, 20000, [&](int i) {
        const char* Bu = B + (i % units) * b_unit;
        const char* Au = A + (i / units) % aunits * a_bytes;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = 0; kb < KB; ++kb) {
            const char* a0 = sa == 64 ? Au + kb * 2048 : Au + kb * 64;
            const char* a1 = sa == 64 ? a0 + 1024 : a0 + 16 * sa;
            const char* b0 = sb == 64 ? Bu + kb * 2048 : Bu + kb * 16 * sb;
            const char* b1 = sb == 64 ? b0 + 1024 : b0 + 64;
            _tile_loadd(4, a0, sa);
            _tile_loadd(6, b0, sb);
            _tile_loadd(7, b1, sb);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1, sa);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, cb, 128);
        _tile_stored(1, cb + 16, 128);
        _tile_stored(2, cb + 512, 128);
        _tile_stored(3, cb + 528, 128);
    });
    _tile_release();
    std::printf("loop sa=%d sb=%d units=%d misalign=%d aunits=%d: %.2f ns a product, %.0f GFLOP/s\n", sa, sb, units, misalign, aunits, s * 1e9 / (KB * 4),
                KB * 4 * 16384 / s / 1e9);
    return 0;
}

// form: 0 gemm_amx on y [M, N]; 1 gemm_amx_swiglu with N = 2I (act [M, I]); 2 gemm_amx then
// silu_mul_bf16, the separate pass the kernel choice weighs the epilogue against.
static int gemm(int M, int N, int K, int weights, int form = 0) {
    const size_t pe = size_t((N + 63) / 64) * (K / 2) * 128;  // pair panels, as pack_bf16_pairs lays them
    std::vector<std::vector<char>> store(weights, std::vector<char>(pe * 2 + 64));
    std::vector<const uint16_t*> P(weights);
    for (int w = 0; w < weights; ++w) {
        uint16_t* p = reinterpret_cast<uint16_t*>(aligned_at(store[w], 0));
        for (size_t i = 0; i < pe; ++i) p[i] = static_cast<uint16_t>(0x3f80 + i % 7);
        P[w] = p;
    }
    std::vector<char> xs(size_t(M) * K * 2 + 64), ys(size_t(M) * N * 2 + 64);
    uint16_t* x = reinterpret_cast<uint16_t*>(aligned_at(xs, 0));
    for (size_t i = 0; i < size_t(M) * K; ++i) x[i] = static_cast<uint16_t>(0x3f00 + i % 5);
    uint16_t* y = reinterpret_cast<uint16_t*>(aligned_at(ys, 0));
    const int reps = std::max(weights, static_cast<int>(2e9 / (double(M) * N * K)));
    std::vector<char> as(size_t(M) * N + 64);
    uint16_t* act = reinterpret_cast<uint16_t*>(aligned_at(as, 0));
    const double s = best_s(9, reps, [&](int i) {
        if (form == 1) {
            gemm_amx_swiglu(P[i % weights], x, act, nullptr, M, N / 2, K);
        } else {
            gemm_amx(P[i % weights], x, y, nullptr, M, N, K);
            if (form == 2) silu_mul_bf16(y, act, M, N / 2, GLU_BLOCK);
        }
    });
    const double flop = 2.0 * M * N * K;
    const int threads = omp_get_max_threads();
    const char* name[3] = {"gemm", "glu", "glusep"};
    std::printf("%s M=%d N=%d K=%d weights=%d threads=%d: %.3f ms, %.0f GFLOP/s, %.2f ns a product per thread, weight %.1f GB/s\n", name[form], M, N,
                K, weights, threads, s * 1e3, flop / s / 1e9, s * 1e9 / (flop / 16384 / threads), double(pe) * 2 / s / 1e9);
    return 0;
}

// The four GEMMs of each of `layers` bench-134m layers (qkv 2304 x 768, o 768 x 768, gate_up
// 4096 x 768, down 768 x 2048), each layer its own weights, back to back as a step runs them;
// the weights' GB/s (210 MB for 12 layers: more than the caches hold).
static int layers(int M, int nl) {
    const int shapes[4][2] = {{2304, 768}, {768, 768}, {4096, 768}, {768, 2048}};
    std::vector<std::vector<char>> store;
    std::vector<const uint16_t*> P;
    size_t bytes = 0;
    for (int l = 0; l < nl; ++l)
        for (const auto& sh : shapes) {
            const size_t pe = size_t((sh[0] + 63) / 64) * (sh[1] / 2) * 128;
            store.emplace_back(pe * 2 + 64);
            uint16_t* p = reinterpret_cast<uint16_t*>(aligned_at(store.back(), 0));
            for (size_t i = 0; i < pe; ++i) p[i] = static_cast<uint16_t>(0x3f80 + i % 7);
            P.push_back(p);
            bytes += pe * 2;
        }
    std::vector<char> xs(size_t(M) * 2048 * 2 + 64), ys(size_t(M) * 4096 * 2 + 64);
    uint16_t* x = reinterpret_cast<uint16_t*>(aligned_at(xs, 0));
    for (size_t i = 0; i < size_t(M) * 2048; ++i) x[i] = static_cast<uint16_t>(0x3f00 + i % 5);
    uint16_t* y = reinterpret_cast<uint16_t*>(aligned_at(ys, 0));
    const double s = best_s(9, 3, [&](int) {
        for (int l = 0; l < nl; ++l)
            for (int g = 0; g < 4; ++g) gemm_amx(P[l * 4 + g], x, y, nullptr, M, shapes[g][0], shapes[g][1]);
    });
    std::printf("layers M=%d layers=%d threads=%d: %.3f ms, weights %.0f MB at %.1f GB/s\n", M, nl, omp_get_max_threads(), s * 1e3, bytes / 1e6,
                bytes / s / 1e9);
    return 0;
}

int main(int argc, char** argv) {
    if (!amx_permitted()) {
        std::printf("the kernel did not grant this process the AMX tiles\n");
        return 1;
    }
    auto arg = [&](int i, int def) { return argc > i ? std::atoi(argv[i]) : def; };
    if (argc > 5 && std::strcmp(argv[1], "loop") && arg(5, 1) < 1) {
        std::printf("WEIGHTS must be >= 1\n");
        return 1;
    }
    if (argc > 1 && !std::strcmp(argv[1], "loop")) return loop(arg(2, 64), arg(3, 64), arg(4, 1), arg(5, 0), arg(6, 1));
    if (argc > 4 && !std::strcmp(argv[1], "gemm")) return gemm(arg(2, 0), arg(3, 0), arg(4, 0), arg(5, 1));
    if (argc > 4 && (!std::strcmp(argv[1], "glu") || !std::strcmp(argv[1], "glusep")) && (arg(3, 0) % 32 || arg(4, 0) % 32)) {
        std::printf("glu, glusep: I and K must be multiples of 32\n");
        return 1;
    }
    if (argc > 4 && !std::strcmp(argv[1], "glu")) return gemm(arg(2, 0), 2 * arg(3, 0), arg(4, 0), arg(5, 1), 1);
    if (argc > 4 && !std::strcmp(argv[1], "glusep")) return gemm(arg(2, 0), 2 * arg(3, 0), arg(4, 0), arg(5, 1), 2);
    if (argc > 2 && !std::strcmp(argv[1], "layers")) return layers(arg(2, 0), arg(3, 12));
    std::printf("usage: %s loop SA SB UNITS MISALIGN [AUNITS] | gemm|glu|glusep M N|I K [WEIGHTS] | layers M [LAYERS]\n", argv[0]);
    return 2;
}
#else
int main() {
    std::printf("built without AMX (needs -march with amx-bf16)\n");
    return 1;
}
#endif
