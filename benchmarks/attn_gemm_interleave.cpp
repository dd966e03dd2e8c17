// Decode attention's tasks between the pair GEMM's panels (docs/SPEED.md, "Decode attention
// between the GEMM's panels (not kept)"): could a B-row decode step hide its K / V reads behind
// the GEMMs' arithmetic on a CPU whose GEMMs leave the memory bus idle (AVX512-BF16, no AMX)?
// 12 layers of bench-134m's shapes (12 KV heads of 64, bf16; its qkv, o, gate_up with SwiGLU,
// down), B sequences of CTX keys in 16-token blocks scattered over twice the blocks needed,
// every layer's weights and cache its own (so they come from memory, as in a step). Includes
// the library's source, so it runs its kernels (pair_tile, the decode task) as they are.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/attn_gemm_interleave.cpp -o /tmp/agi
//   OMP_NUM_THREADS=2 /tmp/agi B CTX MODE [LINES [STEPS]]
//
// MODE 0: in turn, as decode_layer runs them (qkv, attention, o, gate_up, down); 3: the GEMMs
// alone (o, gate_up and down through this file's panel loop, as in modes 1 and 2, which has no
// next-panel prefetch, unlike gemm_pairs in mode 0); 1: o, gate_up and down with one attention task (a sequence, all heads) after each of
// the thread's panels, the next task's K and V prefetched into L2, LINES lines after each
// 6-row tile of the panel (the tasks left over run after down); 2: as 1, the task's own
// prefetch on as well. The attention's inputs do not depend on the GEMMs' outputs here (an
// upper bound for a two-micro-batch pipeline). Prints the median and best ms of a 12-layer
// step over STEPS steps and the mean ms a step spent in the interleaved tasks per thread.
#ifndef KERNEL
#define KERNEL "../iterserve/model/csrc/cpu_kernels.cpp"
#endif
#include KERNEL
#include <chrono>
#include <random>
#include <algorithm>
#include <cstdio>
static double T_task[2];  // per thread (the first two): seconds in the interleaved tasks
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
struct Range { const char* p; int64_t n; };
struct Cursor {  // lines still to prefetch for the next task
    std::vector<Range> r; size_t i = 0; int64_t off = 0;
    void tick(int lines) {
        while (lines > 0 && i < r.size()) {
            __builtin_prefetch(r[i].p + off, 0, 2);
            off += 64; --lines;
            if (off >= r[i].n) { ++i; off = 0; }
        }
    }
};
int main(int argc, char** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s B CTX MODE [LINES [STEPS]]\n", argv[0]); return 2; }
    int B = atoi(argv[1]), ctx = atoi(argv[2]), mode = atoi(argv[3]); int lines = argc > 4 ? atoi(argv[4]) : 64; int reps = argc > 5 ? atoi(argv[5]) : 10;
    const int L = 12, hid = 768, H = 12, hd = 64, inter = 2048, bs = 16, row = H * hd;
    const int per = (ctx + bs - 1) / bs, nb = 2 * B * per;
    std::mt19937 g(0);
    auto fill = [&](std::vector<uint16_t>& v) { for (auto& e : v) { float f = ((int)(g() % 2001) - 1000) / 30000.f; uint32_t u; memcpy(&u, &f, 4); e = u >> 16; } };
    struct W { std::vector<uint16_t> qkv, o, gu, dn, k, v; std::vector<int64_t> bt; };
    std::vector<W> ws(L);
    for (auto& w : ws) {
        w.qkv.resize((size_t)3 * hid * hid); w.o.resize((size_t)hid * hid); w.gu.resize((size_t)2 * inter * hid); w.dn.resize((size_t)hid * inter);
        fill(w.qkv); fill(w.o); fill(w.gu); fill(w.dn);
        w.k.resize((size_t)nb * bs * row); w.v.resize(w.k.size()); fill(w.k); fill(w.v);
        std::vector<int64_t> perm(nb); for (int i = 0; i < nb; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), g);
        w.bt.assign(perm.begin(), perm.begin() + (size_t)B * per);
    }
    std::vector<uint16_t> x((size_t)B * inter), y((size_t)B * 4 * inter), q((size_t)B * row), att((size_t)B * row);
    fill(x); fill(q);
    std::vector<int64_t> lens(B, ctx), starts(B, 0);
    const DecodeTask fast = decode_task_for(hd);
    std::vector<double> ts;
    for (int it = 0; it < reps; ++it) {
        double t0 = now();
        for (int l = 0; l < L; ++l) {
            W& w = ws[l];
            gemm_pairs(w.qkv.data(), x.data(), y.data(), nullptr, B, 3 * hid, hid);
            if (mode == 0) {
                paged_decode_attention(q.data(), row, 0, w.k.data(), w.v.data(), 0, w.bt.data(), lens.data(), starts.data(), att.data(), B, H, H, hd, bs, per, 0.125f, -8);
                gemm_pairs(w.o.data(), x.data(), y.data(), nullptr, B, hid, hid);
                gemm_pairs_swiglu(w.gu.data(), x.data(), y.data(), nullptr, B, inter, hid);
                gemm_pairs(w.dn.data(), x.data(), y.data(), nullptr, B, hid, inter);
                continue;
            }
#pragma omp parallel
            {
                int tid = omp_get_thread_num(), nth = omp_get_num_threads();
                int d = B * tid / nth, d_end = B * (tid + 1) / nth;
                std::vector<float> scores, vbuf, acc((size_t)row), qf((size_t)row);
                Cursor cur;
                auto aim = [&](int dd) {  // the cursor at task dd's K / V
                    cur.r.clear(); cur.i = 0; cur.off = 0;
                    if (dd >= d_end) return;
                    const int64_t* bt = w.bt.data() + (int64_t)dd * per;
                    for (int b = 0; b < per; ++b) {
                        cur.r.push_back({reinterpret_cast<const char*>(w.k.data() + bt[b] * bs * row), (int64_t)bs * row * 2});
                        cur.r.push_back({reinterpret_cast<const char*>(w.v.data() + bt[b] * bs * row), (int64_t)bs * row * 2});
                    }
                };
                auto task = [&](int dd, int ahead) {
                    load_row(q.data(), 0, (int64_t)dd * row, row, qf.data());
                    fast(qf.data(), w.k.data(), w.v.data(), w.bt.data() + (int64_t)dd * per, bs, 0, ctx, H, 1, 0, H, 0.125f, ahead, scores, vbuf, acc.data());
                    store_row(att.data(), 0, (int64_t)dd * row, row, acc.data());
                };
                aim(d);
                auto side = [&]() {
                    if (d >= d_end || mode == 3) return;
                    { double a = now(); task(d, mode == 2 ? -8 : 0); if (tid < 2) T_task[tid] += now() - a; } ++d; aim(d);
                };
                auto gemm = [&](const uint16_t* P, void* yy, int N, int K, bool glu) {
                    const int K2 = K / 2, panels = (N + 63) / 64; const int64_t pe = (int64_t)K2 * 128;
                    const int64_t ldy = glu ? N / 2 : N;
                    const auto [p0, p1] = thread_share(panels);
                    for (int p = p0; p < p1; ++p) {
                        const uint16_t* Pp = P + p * pe; int n0 = p * 64; int m0 = 0;
                        for (; B - m0 >= 6; m0 += 6) {
                            if (glu) pair_tile<6, 0, false, true>(Pp, x.data(), K, nullptr, yy, ldy, N, K2, n0, m0);
                            else pair_tile<6, 0, false, false>(Pp, x.data(), K, nullptr, yy, ldy, N, K2, n0, m0);
                            cur.tick(lines);
                        }
                        for (; m0 < B; ++m0) {
                            if (glu) pair_tile<1, 0, false, true>(Pp, x.data(), K, nullptr, yy, ldy, N, K2, n0, m0);
                            else pair_tile<1, 0, false, false>(Pp, x.data(), K, nullptr, yy, ldy, N, K2, n0, m0);
                        }
                        side();
                    }
#pragma omp barrier
                };
                gemm(w.o.data(), y.data(), hid, hid, false);
                gemm(w.gu.data(), y.data(), 2 * inter, hid, true);
                gemm(w.dn.data(), y.data(), hid, inter, false);
                if (mode != 3) while (d < d_end) { task(d, -8); ++d; }
            }
        }
        ts.push_back((now() - t0) * 1e3);
    }
    std::sort(ts.begin(), ts.end());
    printf("task %.2f / %.2f ms a step (thread 0 / 1)\n", T_task[0]*1e3/reps, T_task[1]*1e3/reps);
    printf("B=%d ctx=%d mode=%d lines=%d: median %.2f ms (min %.2f) a step of 12 layers\n", B, ctx, mode, lines, ts[ts.size() / 2], ts[0]);
}
