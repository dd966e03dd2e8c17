"""Part 2 of benchmarks/gpu_check.sh: decode step time against the HBM roofline, eager
against CUDA graphs, for a Llama-3-8B-shaped bf16 model at batch 1, 8, 32, 128, 256.

One ModelRunner (graphs captured up to the largest batch); every sequence sits at ``--ctx``
tokens of context (the pool is zero-filled, not prefilled: attention reads the same bytes
whatever they hold). A step is ``runner.execute`` plus the argmax and its copy to the host,
which is the engine's one sync per step; scheduling is not included. Median of ``--steps``
steps after warm-up; eager steps run the same runner with its graphs set aside.

Roofline: (weight bytes + batch x ctx x KV bytes per token) / 4.8 TB/s (H200 HBM3e), i.e.
``iterserve.sim.roofline.decode_step_bound``'s memory term.

    PYTHONPATH=. python benchmarks/gpu/decode_roofline.py --device cuda
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import H200_HBM_BYTES_PER_S, LLAMA3_8B, TINY, Report, parser, sync, work_dir  # noqa: E402

from iterserve.config import CacheConfig  # noqa: E402
from iterserve.model.runner import BatchItem, ModelRunner  # noqa: E402
from iterserve.sim.roofline import DecoderShape  # noqa: E402


def main() -> int:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    ns = p.parse_args()
    from common import write_llama_checkpoint

    shape = TINY if ns.tiny else LLAMA3_8B
    batches = [1, 4] if ns.tiny else [int(b) for b in ns.batches.split(",")]
    ctx, steps = (64, 3) if ns.tiny else (ns.ctx, ns.steps)
    dev = ns.device
    path = write_llama_checkpoint(
        f"{work_dir(ns)}/{'tiny' if ns.tiny else 'llama3-8b'}-bf16", shape, torch.bfloat16, dev
    )
    bs = 16
    per_seq = -(-(ctx + steps * 2 + 8) // bs)
    t0 = time.perf_counter()
    runner = ModelRunner(
        path,
        dtype="bfloat16",
        device=dev,
        max_model_len=ctx + steps * 2 + 8,
        cache_config=CacheConfig(block_size=bs, num_kv_blocks=per_seq * max(batches)),
        max_num_seqs=max(batches),
        enforce_eager=dev != "cuda",
    )
    load_s = time.perf_counter() - t0
    s = DecoderShape.of(runner.model_config)
    rep = Report(ns, "decode_roofline", "2. Decode step time against the HBM roofline")
    rep.line(
        f"{'tiny' if ns.tiny else 'Llama-3-8B'}-shaped, bf16, {runner.num_params / 1e9:.2f} "
        f"B params, context {ctx} tokens, median of {steps} steps; runner load + graph "
        f"capture {load_s:.0f} s"
    )
    rep.line()

    def step(b: int, pos: int) -> float:
        items = [
            BatchItem(f"s{i}", [7], pos, list(range(i * per_seq, (i + 1) * per_seq)), True)
            for i in range(b)
        ]
        sync(dev)
        t = time.perf_counter()
        runner.execute(items).argmax(-1).tolist()  # the step's one device-to-host sync
        return time.perf_counter() - t

    rows, data = [], []
    graphs = runner.graphs
    for b in batches:
        kv_bytes = b * ctx * s.kv_bytes_per_token(2)
        weight_bytes = s.matmul_params * 2
        bound = (weight_bytes + kv_bytes) / H200_HBM_BYTES_PER_S
        res = {}
        for mode in ("eager", "graphs"):
            if mode == "graphs" and graphs is None:
                continue
            runner.graphs = graphs if mode == "graphs" else None
            for w in range(3):
                step(b, ctx + w)
            times = [step(b, ctx + 3 + k) for k in range(steps)]
            res[mode] = statistics.median(times)
        runner.graphs = graphs
        cells = [b, f"{(weight_bytes + kv_bytes) / 1e9:.2f}", f"{bound * 1e3:.2f}"]
        for mode in ("eager", "graphs"):
            t = res.get(mode)
            cells += ["-", "-"] if t is None else [f"{t * 1e3:.2f}", f"{bound / t:.0%}"]
        rows.append(cells)
        data.append({"batch": b, "bytes": weight_bytes + kv_bytes, "bound_s": bound, **res})
    rep.table(
        [
            "batch",
            "GB read",
            "roofline ms",
            "eager ms",
            "eager % of roofline",
            "graphs ms",
            "graphs % of roofline",
        ],
        rows,
    )
    rep.line()
    rep.line("Target (a benchmark figure, not a test): batch 1 with graphs >= 70% of the roofline.")
    rep.data["steps"] = data
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
