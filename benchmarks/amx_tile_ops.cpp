// What one AMX tile operation costs on this CPU, one thread, ns per operation (docs/SPEED.md,
// "Where the AMX kernels' time goes"): each kind alone, the prefill attention kernel's two
// patterns (the score tiles: zero, 2 k steps of 2 x 2 products, store; P . V: the output tiles
// loaded, 8 products, stored), and the 2 x 2 tile loop (four 1 KB tile loads, four products)
// over a working set of 4 KB to 192 KB, so its operands come from L1 or from L2. No library
// code: the instructions alone. Build and run:
//
//   g++ -O3 -march=native -std=c++17 benchmarks/amx_tile_ops.cpp -o /tmp/amx_tile_ops && /tmp/amx_tile_ops
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
namespace {
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ns per operation of body (ops operations a call), best of 5 rounds of n calls
template <typename F>
double per_op(int n, int ops, F&& body) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
        const double t0 = now();
        for (int i = 0; i < n; ++i) body();
        const double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    return best / n / ops * 1e9;
}

alignas(64) uint16_t A[8][16 * 32];
alignas(64) uint16_t B[8][16 * 32];
alignas(64) float C[4][16 * 16];

// The 2 x 2 step: A tiles 4-5, B tiles 6-7 loaded, then the four products into 0-3.
inline void step2x2(const void* a0, const void* a1, const void* b0, const void* b1) {
    _tile_loadd(4, a0, 64);
    _tile_loadd(5, a1, 64);
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

// P . V for output tile T: two V tiles into 6-7, then T += P (4-5) . V. A macro: GCC's tile
// intrinsics take the tile numbers as literal text.
#define PV_PAIR(T, v0, v1)          \
    do {                            \
        _tile_loadd(6, v0, 64);     \
        _tile_loadd(7, v1, 64);     \
        _tile_dpbf16ps(T, 4, 6);    \
        _tile_dpbf16ps(T, 5, 7);    \
    } while (0)

inline void store4() {
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
    _tile_stored(2, C[2], 64);
    _tile_stored(3, C[3], 64);
}
}  // namespace

int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        std::printf("the kernel did not grant this process the AMX tiles\n");
        return 1;
    }
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    const int n = 200000;
    std::printf("product, 4 independent accumulators     %6.2f ns\n", per_op(n, 4, [] {
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }));
    std::printf("product, one accumulator (dependent)    %6.2f ns\n", per_op(n, 4, [] {
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(0, 5, 7);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(0, 5, 7);
                }));
    std::printf("tile load (1 KB, L1)                    %6.2f ns\n", per_op(n, 4, [] {
                    _tile_loadd(4, A[0], 64);
                    _tile_loadd(5, A[1], 64);
                    _tile_loadd(6, B[0], 64);
                    _tile_loadd(7, B[1], 64);
                }));
    std::printf("tile store (1 KB, L1)                   %6.2f ns\n", per_op(n, 4, [] { store4(); }));
    std::printf("2 x 2 loop: 4 loads, 4 products         %6.2f ns a product\n",
                per_op(n, 4, [] { step2x2(A[0], A[1], B[0], B[1]); }));
    std::printf("attention scores: zero, 2 x (4 loads, 4 products), store 4  %6.2f ns a product\n", per_op(n, 8, [] {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int k = 0; k < 2; ++k) step2x2(A[2 * k], A[2 * k + 1], B[2 * k], B[2 * k + 1]);
                    store4();
                }));
    std::printf("attention P . V: load 4 O + 2 P, 4 x (2 V, 2 products), store 4  %6.2f ns a product\n", per_op(n, 8, [] {
                    _tile_loadd(0, C[0], 64);
                    _tile_loadd(1, C[1], 64);
                    _tile_loadd(2, C[2], 64);
                    _tile_loadd(3, C[3], 64);
                    _tile_loadd(4, A[0], 64);
                    _tile_loadd(5, A[1], 64);
                    PV_PAIR(0, B[0], B[1]);
                    PV_PAIR(1, B[2], B[3]);
                    PV_PAIR(2, B[4], B[5]);
                    PV_PAIR(3, B[6], B[7]);
                    store4();
                }));
    // The 2 x 2 loop over a working set: 24 k steps of four consecutive 1 KB tiles, wrapping.
    for (int kb : {4, 8, 16, 32, 48, 64, 96, 192}) {
        std::vector<char> buf(static_cast<size_t>(kb) * 1024 + 64, 1);
        char* w = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
        const double ns = per_op(20000, 96, [&] {
            for (int k = 0; k < 24; ++k) {
                const int j = k * 4;
                step2x2(w + (j % kb) * 1024, w + ((j + 1) % kb) * 1024, w + ((j + 2) % kb) * 1024, w + ((j + 3) % kb) * 1024);
            }
        });
        std::printf("2 x 2 loop over %3d KB of tiles          %6.2f ns a product\n", kb, ns);
    }
    _tile_release();
    return 0;
}
#else
int main() {
    std::printf("built without AMX (needs -march with amx-bf16, on a CPU that has it)\n");
    return 1;
}
#endif
