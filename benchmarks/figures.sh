#!/usr/bin/env bash
# Reproduces the figures and pictures in BENCHMARKS.md (results under results/, pictures
# under docs/img/). Heavy on a small CPU box: run it when the machine is otherwise idle.
#   REPEATS   offline repetitions (medians are reported)            default 3
#   MODEL     model for every run                                    default bench-134m
#   DTYPE                                                            default bfloat16
#   SCALE     --length-scale of the ShareGPT lengths                  default 0.05
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${REPEATS:-3}
MODEL=${MODEL:-bench-134m}
DTYPE=${DTYPE:-bfloat16}
SCALE=${SCALE:-0.05}
OUT=results/bench
mkdir -p "$OUT" docs/img
common=(--model "$MODEL" --dtype "$DTYPE" --dataset sharegpt --length-scale "$SCALE" --no-progress)

# 1. Offline: 128 ShareGPT-shaped requests, all at once, through each policy (repeated).
for i in $(seq 1 "$REPEATS"); do
  python -m iterserve.bench.cli offline "${common[@]}" --num-prompts 128 \
    --result-file "$OUT/offline_$i.json"
done
python benchmarks/median_table.py "$OUT"/offline_*.json

# 2. Batch timeline: a smaller run whose Gantt chart stays readable (48 requests, 16 slots).
python -m iterserve.bench.cli offline "${common[@]}" --num-prompts 48 --max-num-seqs 16 \
  --policies static,continuous --result-file "$OUT/timeline.json" --record-steps "$OUT/steps"
python -m iterserve.bench.plot timeline "$OUT/timeline.json" --out docs/img/timeline_static_vs_continuous.png

# 3. Rate sweep, light load to overload, and its pictures.
python -m iterserve.bench.cli sweep "${common[@]}" --num-prompts 48 --policies static,continuous \
  --request-rates auto --goodput ttft:5000 tpot:500 --result-file "$OUT/sweep.json"
python -m iterserve.bench.plot curves "$OUT/sweep.json" --out docs/img/sweep_latency_vs_throughput.png
python -m iterserve.bench.plot cdf "$OUT/sweep.json" --out docs/img/sweep_latency_cdf.png
python -m iterserve.bench.plot cdf "$OUT"/offline_1.json --out docs/img/offline_latency_cdf.png
