"""Cost of structured outputs per engine step: the sampler with k of B rows under a grammar
(their matchers fill the step's token bitmask, the sampler masks those rows) against the same
batch with none constrained, on a model's real vocabulary. Also each grammar library's
compile time and per-token mask fill (the measurements behind choosing xgrammar).

    PYTHONPATH=. python benchmarks/structured.py                      # smollm2-135m vocab
    PYTHONPATH=. python benchmarks/structured.py --model tiny-random --batch 8 --steps 50
    PYTHONPATH=. python benchmarks/structured.py --backends           # + xgrammar vs llguidance

Per-step time = fill (matchers write their rows) + sample (penalty-free greedy argmax, the mask
applied to the k rows); matchers advance on a fixed valid walk, so every step sees a live
grammar state. Medians over ``--steps`` steps, after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
NESTED = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                    "price": {"type": "number"},
                },
                "required": ["id", "tags", "price"],
            },
        },
        "owner": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "format": "email"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["email"],
        },
    },
    "required": ["items", "owner"],
}
# A valid instance of SCHEMA, long enough that matchers never finish during the run.
WALK = json.dumps({"name": "Ada " * 200, "age": 36, "tags": ["x"]}, separators=(", ", ": "))


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def step_cost(model: str, batch: int, ks: list[int], steps: int) -> None:
    from iterserve.engine.tokenizer import load_tokenizer
    from iterserve.model.builtin import resolve_model
    from iterserve.model.model_config import ModelConfig
    from iterserve.model.sampler import SampleRow, sample
    from iterserve.sampling_params import SamplingParams
    from iterserve.structured import StructuredOutputsParams
    from iterserve.structured.grammar import GrammarCompiler, TokenBitmask

    path = resolve_model(model)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    tok = load_tokenizer(path)
    comp = GrammarCompiler(tok, vocab, [int(tok.eos_token_id or 0)])
    compiled = comp.compile(StructuredOutputsParams(json=SCHEMA))
    walk = tok.encode(WALK, add_special_tokens=False)
    rows = [SampleRow(SamplingParams(temperature=0.0), None, None) for _ in range(batch)]  # type: ignore[arg-type]
    bm = TokenBitmask(vocab)
    print(f"model {model} (vocab {vocab}), batch {batch}, {steps} steps, greedy; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print("each step samples the same logits twice, unconstrained then with k rows masked;")
    print("extra = median of the paired differences (fill + mask), robust to a busy machine")
    print(f"{'k':>4} {'fill ms':>8} {'mask ms':>8} {'step k=0 ms':>12} {'step ms':>8} "
          f"{'extra ms':>9}")  # fmt: skip
    from iterserve.model.sampler import _apply_grammar_mask

    for k in ks:
        matchers = [comp.matcher(compiled) for _ in range(k)]
        fills, masks, bases, steps_k, extra = [], [], [], [], []
        for s in range(steps + 5):
            logits = torch.randn(batch, vocab)
            lb = logits.clone()
            t0 = time.perf_counter()
            sample(lb, rows, None, None)
            t1 = time.perf_counter()
            lc = logits.clone()
            t2 = time.perf_counter()
            bits = bm.rows(batch)
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bits, i)
            t3 = time.perf_counter()
            _apply_grammar_mask(lc, (bits, list(range(k))))
            t4 = time.perf_counter()
            sample(lc, rows, None, None)  # the mask is already applied: the rest of sample()
            t5 = time.perf_counter()
            for m in matchers:
                assert m.accept_token(walk[min(s, len(walk) - 1)])
            if s >= 5:
                fills.append(t3 - t2)
                masks.append(t4 - t3)
                bases.append(t1 - t0)
                steps_k.append(t5 - t2)
                extra.append((t5 - t2) - (t1 - t0))
        cols = [_median_ms(x) for x in (fills, masks, bases, steps_k, extra)]
        print(f"{k:>4} {cols[0]:>8.3f} {cols[1]:>8.3f} {cols[2]:>12.3f} {cols[3]:>8.3f} "
              f"{cols[4]:>+9.3f}")  # fmt: skip


def backends(model: str) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt
    import xgrammar as xgr

    from iterserve.engine.tokenizer import load_tokenizer
    from iterserve.model.builtin import resolve_model
    from iterserve.model.model_config import ModelConfig

    path = resolve_model(model)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    tok = load_tokenizer(path)
    walk = tok.encode(WALK[:400], add_special_tokens=False)[:60]
    print(f"\nbackends on {model} (vocab {vocab}); fill = one row, median over {len(walk)} tokens")
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)  # type: ignore[arg-type]
    print(
        f"xgrammar {version('xgrammar')}: tokenizer info {(time.perf_counter() - t) * 1e3:.0f} ms"
    )
    c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    for name, s in (("flat", SCHEMA), ("nested", NESTED)):
        t = time.perf_counter()
        g = c.compile_json_schema(json.dumps(s), any_whitespace=False)
        print(f"  compile {name}: {(time.perf_counter() - t) * 1e3:.1f} ms")
    g = c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    m = xgr.GrammarMatcher(g)
    bits = xgr.allocate_token_bitmask(32, vocab)
    fills = []
    for tid in walk:
        t = time.perf_counter()
        m.fill_next_token_bitmask(bits, 0)
        fills.append(time.perf_counter() - t)
        assert m.accept_token(tid)
    logits = torch.randn(32, vocab)
    t = time.perf_counter()
    for _ in range(20):
        xgr.apply_token_bitmask_inplace(logits, bits, indices=list(range(8)))
    apply = (time.perf_counter() - t) / 20
    print(f"  fill median {_median_ms(fills) * 1e3:.0f} us (max {max(fills) * 1e6:.0f} us); "
          f"apply 8 of 32 rows {apply * 1e6:.0f} us")  # fmt: skip

    t = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)  # type: ignore[arg-type]
    print(
        f"llguidance {llguidance.__version__}: tokenizer {(time.perf_counter() - t) * 1e3:.0f} ms"
    )
    for name, s in (("flat", SCHEMA), ("nested", NESTED)):
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s))
        lm = llguidance.LLMatcher(ltok, grammar)
        print(f"  compile {name}: {(time.perf_counter() - t) * 1e3:.1f} ms")
    lm = llguidance.LLMatcher(
        ltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    )
    lbits = lgt.allocate_token_bitmask(32, ltok.vocab_size)
    fills = []
    for tid in walk:
        t = time.perf_counter()
        lgt.fill_next_token_bitmask(lm, lbits, 0)
        fills.append(time.perf_counter() - t)
        assert lm.consume_token(tid), lm.get_error()
    t = time.perf_counter()
    lgt.apply_token_bitmask_inplace(logits[:8], lbits[:8])  # its torch path compiles first
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(5):
        lgt.apply_token_bitmask_inplace(logits[:8], lbits[:8])
    apply = (time.perf_counter() - t) / 5
    print(f"  fill median {_median_ms(fills) * 1e3:.0f} us (max {max(fills) * 1e6:.0f} us); "
          f"apply 8 rows {apply * 1e6:.0f} us (first call {first:.1f} s)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", default="0,1,4,16,32", help="numbers of constrained rows")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--backends", action="store_true", help="also compare xgrammar, llguidance")
    a = ap.parse_args()
    ks = [int(x) for x in a.k.split(",") if int(x) <= a.batch]
    step_cost(a.model, a.batch, ks, a.steps)
    if a.backends:
        backends(a.model)


if __name__ == "__main__":
    main()
