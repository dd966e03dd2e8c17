"""Part 3 of benchmarks/gpu_check.sh: prefill throughput at 2k-token prompts, and its share of
the bf16 tensor-core peak (~790 TFLOP/s on an H200), Llama-3-8B-shaped, bf16.

Each step is ``runner.execute`` of ``--prompts-per-step`` fresh 2048-token prompts (one launch
of the varlen prefill kernel per layer) plus the logits' copy to the host; median of
``--steps`` steps after warm-up. FLOPs per step: 2 x block params x tokens + causal attention
(QK^T and PV at each token's context) + the LM head on each prompt's last token
(``iterserve.sim.roofline``'s counting).

    PYTHONPATH=. python benchmarks/gpu/prefill.py --device cuda
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    H200_BF16_FLOPS,
    LLAMA3_8B,
    TINY,
    Report,
    parser,
    sync,
    work_dir,
    write_llama_checkpoint,
)

from iterserve.config import CacheConfig  # noqa: E402
from iterserve.model.runner import BatchItem, ModelRunner  # noqa: E402
from iterserve.sim.roofline import DecoderShape  # noqa: E402


def main() -> int:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--prompts-per-step", default="1,4")
    p.add_argument("--steps", type=int, default=5)
    ns = p.parse_args()
    shape = TINY if ns.tiny else LLAMA3_8B
    n_tok, steps = (256, 2) if ns.tiny else (ns.prompt_len, ns.steps)
    per_step = [int(x) for x in ns.prompts_per_step.split(",")]
    dev, bs = ns.device, 16
    path = write_llama_checkpoint(
        f"{work_dir(ns)}/{'tiny' if ns.tiny else 'llama3-8b'}-bf16", shape, torch.bfloat16, dev
    )
    per_seq = -(-n_tok // bs)
    runner = ModelRunner(
        path,
        dtype="bfloat16",
        device=dev,
        max_model_len=n_tok,
        cache_config=CacheConfig(block_size=bs, num_kv_blocks=per_seq * max(per_step)),
        max_num_seqs=max(per_step),
        enforce_eager=True,  # prefill steps never replay graphs
    )
    s = DecoderShape.of(runner.model_config)
    rep = Report(ns, "prefill", "3. Prefill throughput at 2k-token prompts")
    gen = torch.Generator().manual_seed(0)
    rows, data = [], []
    for k in per_step:
        items = [
            BatchItem(
                f"p{i}",
                torch.randint(5, s.vocab, (n_tok,), generator=gen).tolist(),
                0,
                list(range(i * per_seq, (i + 1) * per_seq)),
                True,
            )
            for i in range(k)
        ]

        def step(items: list[BatchItem] = items) -> float:
            sync(dev)
            t = time.perf_counter()
            runner.execute(items).argmax(-1).tolist()
            return time.perf_counter() - t

        step()
        step()
        t = statistics.median(step() for _ in range(steps))
        tokens = k * n_tok
        flops = (
            2.0 * s.layer_params * tokens
            + k * 2.0 * s.head_params
            + k * s.layers * s.attn_flops_per_key * n_tok * (n_tok + 1) / 2
        )
        share = flops / t / H200_BF16_FLOPS
        rows.append(
            [
                k,
                tokens,
                f"{t * 1e3:.1f}",
                f"{tokens / t:,.0f}",
                f"{flops / t / 1e12:.1f}",
                f"{share:.0%}",
            ]
        )
        data.append({"prompts": k, "tokens": tokens, "step_s": t, "flops": flops})
    rep.line(
        f"{'tiny' if ns.tiny else 'Llama-3-8B'}-shaped, bf16, prompts of {n_tok} tokens, "
        f"median of {steps} steps"
    )
    rep.line()
    rep.table(
        ["prompts/step", "tokens", "step ms", "tokens/s", "TFLOP/s", "share of 790 TFLOP/s"], rows
    )
    rep.line()
    rep.line("Target (a benchmark figure, not a test): >= 50% of the bf16 peak.")
    rep.data["steps"] = data
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
