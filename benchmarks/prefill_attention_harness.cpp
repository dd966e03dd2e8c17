// paged_prefill_attention from C++, no Python in the loop (docs/SPEED.md, "Denormals, the K
// packing and two threads for the row-wise kernels"): one chunk of N queries at positions
// P0 .. P0 + N - 1 against all its keys, bench-134m's shape (12 heads of 64 over 12 KV heads,
// bf16, blocks of 16 scattered in a pool three times the size needed); median ms of REPEATS
// calls after one warm-up, and the largest error against a double-precision softmax attention
// on every 37th query row of heads 0 and 7. The library's source is included, so a copy of it
// with a change (an experiment) builds the same way with KERNEL pointing at the copy. From the
// repository root:
//
//   g++ -O3 -march=native -fopenmp -std=c++17 benchmarks/prefill_attention_harness.cpp -o /tmp/pah
//   OMP_NUM_THREADS=2 /tmp/pah 2048 0 15     # N P0 REPEATS
//
// Load torch's libgomp (LD_PRELOAD=.../torch/lib/libgomp.so.1) to run under the OpenMP runtime
// the engine uses.
#ifndef KERNEL
#define KERNEL "../iterserve/model/csrc/cpu_kernels.cpp"
#endif
#include KERNEL
#include <malloc.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
    // as iterserve's tune_allocator: large buffers stay in the heap between calls
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    const int n = argc > 1 ? std::atoi(argv[1]) : 2048, p0 = argc > 2 ? std::atoi(argv[2]) : 0;
    const int reps = argc > 3 ? std::atoi(argv[3]) : 9;
    const int H = 12, KvH = 12, hd = 64, bs = 16;
    const int ctx = p0 + n, per = (ctx + bs - 1) / bs, nb = 3 * per;
    std::mt19937 g(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<uint16_t> kc(static_cast<size_t>(nb) * bs * KvH * hd), vc(kc.size());
    std::vector<uint16_t> q(static_cast<size_t>(n) * 3 * H * hd), out(static_cast<size_t>(n) * H * hd);
    for (auto& x : kc) x = f32_to_bf16(nd(g));
    for (auto& x : vc) x = f32_to_bf16(nd(g));
    for (auto& x : q) x = f32_to_bf16(nd(g));  // q is a view of qkv: rows 3 * H * hd apart
    std::vector<int64_t> table(nb);
    for (int i = 0; i < nb; ++i) table[i] = i;
    std::shuffle(table.begin(), table.end(), g);
    table.resize(per);
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    std::vector<double> ms;
    for (int r = 0; r <= reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        if (paged_prefill_attention(q.data(), 3 * H * hd, kc.data(), vc.data(), table.data(), bs, n, p0, H, KvH, hd, scale, out.data()) != 0) {
            std::printf("paged_prefill_attention is not compiled in on this CPU\n");
            return 1;
        }
        if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    double err = 0;
    for (int h : {0, 7})
        for (int i = 0; i < n; i += 37) {
            const int pos = p0 + i;
            std::vector<double> s(pos + 1);
            double mx = -1e300, l = 0;
            auto row = [&](const std::vector<uint16_t>& c, int k) {
                const int64_t slot = table[k / bs] * bs + k % bs;
                return c.data() + (slot * KvH + h) * hd;  // KvH == H: head h's own KV head
            };
            for (int k = 0; k <= pos; ++k) {
                double d = 0;
                for (int e = 0; e < hd; ++e) d += static_cast<double>(bf16_to_f32(q[static_cast<size_t>(i) * 3 * H * hd + h * hd + e])) * bf16_to_f32(row(kc, k)[e]);
                s[k] = d * scale;
                mx = std::max(mx, s[k]);
            }
            for (auto& x : s) l += (x = std::exp(x - mx));
            for (int e = 0; e < hd; ++e) {
                double o = 0;
                for (int k = 0; k <= pos; ++k) o += s[k] * bf16_to_f32(row(vc, k)[e]);
                err = std::max(err, std::fabs(o / l - bf16_to_f32(out[static_cast<size_t>(i) * H * hd + h * hd + e])));
            }
        }
    const double gflop = 4.0 * n * (p0 + (n + 1) / 2.0) * H * hd / 1e9;
    const double med = ms[ms.size() / 2];
    std::printf("%d queries from position %d: median %.2f ms (%.0f GFLOP/s), best %.2f; max error %.5f\n", n, p0, med, gflop / med * 1e3, ms[0],
                err);
    return 0;
}
