"""iterserve's roofline against Vidur's measured H100 operator profile (Llama-2-7B, TP1/TP2).

    python benchmarks/sim_vidur_compare.py

Vidur predicts a batch's time from operator times profiled on the GPU; iterserve's
``RooflineCostModel`` from datasheet peaks and efficiency factors. Vidur's public H100
profile of Llama-2-7B's token-parallel operators is the one both can be checked on here
(Vidur runs here only on hand-made profiles, ``benchmarks/vidur_e2e.py``; its own cannot be
fetched: see SIMULATOR.md). The medians below are copied
from microsoft/vidur ``data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv`` at
commit e26eb8f79fa9a6a7c38eac0f5291302402b20364 (columns ``time_stats.{attn_pre_proj,
attn_post_proj,mlp_up_proj,mlp_down_proj}.median``, milliseconds per layer).
"""

from __future__ import annotations

import sys

from iterserve.sim.cost_model import RooflineCostModel
from iterserve.sim.hardware import HARDWARE
from iterserve.sim.models import load_model_config

# (tensor parallel, tokens) -> (qkv, o, gate/up, down) medians in ms, one layer.
VIDUR_H100_LLAMA2_7B: dict[tuple[int, int], tuple[float, float, float, float]] = {
    (1, 1): (0.038, 0.016, 0.064, 0.038),
    (1, 2): (0.036, 0.016, 0.063, 0.036),
    (1, 4): (0.036, 0.016, 0.064, 0.036),
    (1, 8): (0.036, 0.016, 0.064, 0.036),
    (1, 16): (0.041, 0.016, 0.0665, 0.037),
    (1, 32): (0.038, 0.016, 0.066, 0.039),
    (1, 64): (0.040, 0.016, 0.066, 0.040),
    (1, 96): (0.065, 0.019, 0.075, 0.045),
    (1, 112): (0.041, 0.019, 0.073, 0.0455),
    (1, 1024): (0.151, 0.049, 0.256, 0.109),
    (1, 1040): (0.170, 0.065, 0.3025, 0.156),
    (1, 1536): (0.222, 0.083, 0.422, 0.182),
    (1, 4096): (0.584, 0.193, 0.987, 0.441),
    (2, 1): (0.020, 0.009, 0.036, 0.020),
    (2, 4096): (0.2815, 0.102, 0.499, 0.217),
    (4, 4096): (0.152, 0.049, 0.260, 0.110),
}


def main() -> int:
    cfg = load_model_config("llama-2-7b")
    hw = HARDWARE["h100-sxm"]
    print("Llama-2-7B on H100 SXM, one decoder layer's projections (qkv + o + gate/up + down), ms")
    print(
        f"{'TP':>3}{'tokens':>8}{'Vidur (measured)':>18}{'iterserve roofline':>20}{'ratio':>8}"
        "   per op (roofline / measured)"
    )
    errs = []
    for (tp, tokens), meas in VIDUR_H100_LLAMA2_7B.items():
        cm = RooflineCostModel(cfg, hw, tp=tp)
        pred = [t * 1e3 for t in cm.projection_times(tokens)]
        ratio = sum(pred) / sum(meas)
        errs.append(abs(ratio - 1))
        per_op = " ".join(f"{p / m:4.2f}" for p, m in zip(pred, meas))
        print(f"{tp:>3}{tokens:>8}{sum(meas):>18.3f}{sum(pred):>20.3f}{ratio:>8.2f}   {per_op}")
    print(f"mean |error| of the layer total: {sum(errs) / len(errs):.1%} over {len(errs)} points")
    return 0


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no arguments (--help included): say what it does
        raise SystemExit(__doc__)
    raise SystemExit(main())
