"""The ``iterserve`` command: one entry point, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable

# The subcommands: name -> ("module:function" taking argv, returning an exit code; help).
# Registering one is one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "iterserve.bench.demo:cli_main",
        "static vs continuous batching on a real model, in one command",
    ),
    "generate": ("iterserve.cli:generate_main", "generate text offline with the in-process engine"),
    "serve": ("iterserve.server.cli:main", "OpenAI-compatible HTTP server"),
    "bench": ("iterserve.bench.cli:main", "benchmarks: serve (online client), offline, sweep"),
    "plot": ("iterserve.bench.plot:main", "pictures from benchmark results: curves, cdf, timeline"),
    "simulate": (
        "iterserve.sim.cli:main",
        "simulate serving with the real scheduler and a cost model",
    ),
    "profile": (
        "iterserve.sim.profile:main",
        "measure step times on this machine and fit a cost profile",
    ),
}


def generate_main(argv: list[str]) -> int:
    from iterserve.config import EngineArgs
    from iterserve.engine import LLM
    from iterserve.sampling_params import SamplingParams

    p = argparse.ArgumentParser(prog="iterserve generate", description="Generate text offline.")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    # Unset: the model's sampling default (--generation-config), else generate's own.
    own = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    for name, kind in (
        ("max_tokens", int),
        ("temperature", float),
        ("top_p", float),
        ("top_k", int),
    ):
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"default: the model's generation config, else {own[name]}",
        )
    p.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    try:
        args = EngineArgs.from_cli_args(ns)
        llm = LLM(**vars(args))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"iterserve generate: error: {e}", file=sys.stderr)
        return 2
    prompts = ns.prompt or ["Hello, my name is", "The capital of France is", "Continuous batching"]
    given = {k: getattr(ns, k) for k in own if getattr(ns, k) is not None}
    try:
        params = SamplingParams.from_defaults(
            {**own, **llm.engine.default_sampling}, **given, seed=ns.sampling_seed
        )
    except ValueError as e:
        print(f"iterserve generate: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    except ValueError as e:  # a prompt the engine refuses (empty, past the context or pool)
        print(f"iterserve generate: error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    failed = 0
    for o in outs:
        c = o.outputs[0]
        print(f"--- {o.prompt!r} -> ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text!r}")
        if o.error is not None:  # the engine's reason, which says what to change
            failed += 1
            print(f"iterserve generate: error: {o.error}", file=sys.stderr)
    st = llm.stats()
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"{len(outs)} requests, {ntok} tokens in {dt:.2f}s, {st['num_steps']} steps, "
        f"{st['num_preemptions']} preemptions, "
        f"prefix-cache hit rate {st['prefix_cache_hit_rate']:.0%}"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from iterserve import __version__

        print(f"iterserve {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: iterserve {" + ",".join(SUBCOMMANDS) + "} ...\n")
        for name, (_, help_) in SUBCOMMANDS.items():
            print(f"  {name:9s} {help_}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\niterserve: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, _, function = SUBCOMMANDS[argv[0]][0].partition(":")
    run: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), function)
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
