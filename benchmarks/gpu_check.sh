#!/usr/bin/env bash
# iterserve on one GPU, in one script (docs/GPU.md): writes $OUT/report.md (+ JSON per part).
#
#   OUT=/tmp/gpu_report bash benchmarks/gpu_check.sh                  # on the H200 (~8 min)
#   OUT=/tmp/gpu_dry bash benchmarks/gpu_check.sh --device cpu --tiny # CPU dry run (~1 min)
#
# Runs from the source tree (PYTHONPATH=.), downloads nothing (random-weight checkpoints are
# written under $OUT/work, reused by later parts), and keeps going when a part fails: each
# part's exit status and time go into the report. Each part has a time cap (470 s in all, so
# the script fits in 8 minutes with start-up); a part that hits it is reported as timed out.
# Parts:
#   0. the GPU, versions
#   1. kernel tests on real CUDA (tests/test_triton_attention.py, tests/test_gpu_path.py);
#      float32 token-exactness and bf16 top-1 agreement vs transformers (gpu/correctness.py)
#   2. decode step time vs the HBM roofline, eager vs CUDA graphs (gpu/decode_roofline.py)
#   3. prefill throughput at 2k-token prompts (gpu/prefill.py)
#   4. a mixed workload, iterserve vs transformers continuous batching (gpu/mixed.py)
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
TINY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY="--tiny"; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--tiny]" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-gpu_report}"
# The caps are the H200's; a CPU dry run (a shared, slower machine) gets 6x each.
SCALE=1
[ "$DEVICE" = cpu ] && SCALE=6
mkdir -p "$OUT/work"
export PYTHONPATH=. OUT ITERSERVE_CACHE="${ITERSERVE_CACHE:-$OUT/work/cache}"
REPORT="$OUT/report.md"
START=$(date +%s)
{
  echo "# iterserve GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  echo
  echo "\`bash benchmarks/gpu_check.sh --device $DEVICE $TINY\` at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo '```'
  python -c "import torch, triton, transformers, platform; print('python', platform.python_version(), '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__); print('cuda available:', torch.cuda.is_available(), '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1
  echo '```'
  echo
} > "$REPORT"

part() {  # part NAME TIMEOUT_S COMMAND...: run, log its tail and status into the report
  local name="$1" limit=$(( $2 * SCALE )); shift 2
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "- $name: exit $rc$([ $rc = 124 ] && echo ' (timed out)') in $(( $(date +%s) - t0 )) s (log: $name.log)" >> "$OUT/status.md"
  return 0
}
: > "$OUT/status.md"

if [ "$DEVICE" = cuda ] && ! python -c "import pytest" 2> /dev/null; then
  echo "## 1a. Kernel tests: NOT RUN (pytest is not installed in this image)" >> "$REPORT"
  echo >> "$REPORT"
elif [ "$DEVICE" = cuda ]; then
  # On CUDA the test modules run the compiled kernels (TRITON_INTERPRET only without a GPU).
  part kernel_tests 75 python -m pytest -q -x -p no:cacheprovider \
    tests/test_triton_attention.py -m "not slow" tests/test_gpu_path.py
  part kernel_sweep 45 python -m pytest -q -p no:cacheprovider tests/test_triton_attention.py -m slow
  { echo "## 1a. Kernel tests on CUDA"; echo; echo '```'; tail -n 5 "$OUT/kernel_tests.log"; tail -n 5 "$OUT/kernel_sweep.log"; echo '```'; echo; } >> "$REPORT"
else
  echo "## 1a. Kernel tests: skipped (they need CUDA; on CPU the suite runs them interpreted)" >> "$REPORT"
  echo >> "$REPORT"
fi
part correctness 80 python benchmarks/gpu/correctness.py --device "$DEVICE" $TINY
part decode_roofline 120 python benchmarks/gpu/decode_roofline.py --device "$DEVICE" $TINY
part prefill 50 python benchmarks/gpu/prefill.py --device "$DEVICE" $TINY
part mixed 100 python benchmarks/gpu/mixed.py --device "$DEVICE" --num-requests 128 $TINY
{
  echo "## Status"
  echo
  cat "$OUT/status.md"
  echo
  echo "Total: $(( $(date +%s) - START )) s"
} >> "$REPORT"
rm -rf "$OUT/work"  # checkpoints (16 GB on the GPU run): not part of the report
cat "$REPORT"
