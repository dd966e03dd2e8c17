// Do AMX tile products and AVX-512 vector work overlap on this CPU? (docs/SPEED.md, "Denormals,
// the K packing and two threads for the row-wise kernels".) One thread, a loop of NT tile
// products (TDPBF16PS, four accumulators, operands loaded once an iteration) and NV vectors of
// exp2 (the prefill attention's exp2_bf16, load + store), in these arrangements:
//   tiles:         the products alone (accumulators zeroed, not stored)
//   vectors:       the vector work alone
//   both:          the products, then the vector work, in one iteration
//   both + store:  the products, the 4 accumulator tiles stored, then the vector work
// ns an iteration (best of 5). Where the two units overlap, "both" is the larger of "tiles" and
// "vectors"; where they do not, their sum. Build and run from the repository root (an AMX CPU):
//
//   g++ -O3 -march=native -std=c++17 benchmarks/amx_overlap.cpp -o /tmp/amx_overlap
//   /tmp/amx_overlap 8 8 && /tmp/amx_overlap 8 32 && /tmp/amx_overlap 8 64    # NT NV
#include "../iterserve/model/csrc/cpu_kernels.cpp"
#include <chrono>
#include <cstdio>
#include <cstdlib>

#if defined(ITERSERVE_AMX)
alignas(64) static uint16_t A[16 * 32], B[16 * 32];
alignas(64) static float C[4][16 * 16], V[4096], W[4096];

template <typename F>
static double best_ns(F&& body) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
        const int reps = 100000;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) body();
        const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
        best = ns < best ? ns : best;
    }
    return best;
}

int main(int argc, char** argv) {
    if (!amx_permitted()) {
        std::printf("the kernel did not grant this process the AMX tiles\n");
        return 1;
    }
    amx_configure_square();
    for (int i = 0; i < 4096; ++i) V[i] = -0.001f * static_cast<float>(i);
    const int nt = argc > 1 ? std::atoi(argv[1]) : 8, nv = argc > 2 ? std::atoi(argv[2]) : 32;
    auto tiles = [&] {
        _tile_loadd(4, A, 64);
        _tile_loadd(6, B, 64);
        for (int t = 0; t < nt; t += 4) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 6);
        }
    };
    auto zero = [] {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    };
    auto store = [] {
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        _tile_stored(2, C[2], 64);
        _tile_stored(3, C[3], 64);
    };
    auto vectors = [&] {
        for (int i = 0; i < nv * 16; i += 16) _mm512_store_ps(W + (i & 4095), exp2_bf16(_mm512_load_ps(V + (i & 4095))));
        __asm__ volatile("" ::: "memory");
    };
    const double t = best_ns([&] { tiles(); zero(); });
    const double v = best_ns(vectors);
    const double b = best_ns([&] { tiles(); vectors(); zero(); });
    const double s = best_ns([&] { tiles(); store(); vectors(); });
    std::printf("%d products, %d vectors: tiles %.1f ns, vectors %.1f, both %.1f (overlapped: %.1f, serial: %.1f), both + store %.1f\n",
                nt, nv, t, v, b, t > v ? t : v, t + v, s);
    _tile_release();
    return 0;
}
#else
int main() {
    std::printf("compiled without AMX (needs an AMX-BF16 CPU and -march=native)\n");
    return 1;
}
#endif
