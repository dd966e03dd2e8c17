"""llama.cpp for the comparison benchmarks (``iterserve.bench.llamacpp``) from the command line.

python benchmarks/llamacpp.py --build          # build (or find) the binaries
python benchmarks/llamacpp.py --gguf bench-134m  # write / find the GGUF, print its path
"""

from __future__ import annotations

import argparse

from iterserve.bench.llamacpp import ensure_built, export_gguf
from iterserve.model.builtin import resolve_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--build", action="store_true", help="build llama.cpp (or find the binaries)")
    ap.add_argument(
        "--gguf", metavar="MODEL", help="write the BF16 GGUF of a model (built-in name or folder)"
    )
    ns = ap.parse_args(argv)
    if ns.build:
        for name, path in ensure_built().items():
            print(f"{name}: {path}")
    if ns.gguf:
        print(export_gguf(resolve_model(ns.gguf)))


if __name__ == "__main__":
    main()
