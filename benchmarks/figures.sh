#!/usr/bin/env bash
# Reproduces the figures and pictures in BENCHMARKS.md (results under results/bench/, pictures
# under docs/img/). Heavy on a small CPU box (about an hour on 2 shared cores): run it when the
# machine is otherwise idle.
#   REPEATS   offline repetitions (medians are reported)            default 3
#   MODEL     model for every run                                    default bench-134m
#   DTYPE                                                            default bfloat16
#   SCALE     --length-scale of the ShareGPT lengths                  default 0.1
#   THREADS   --num-threads (1: on a shared 2-core box, two OpenMP threads that get
#             preempted by other processes were 5x slower than one)  default 1
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${REPEATS:-3}
MODEL=${MODEL:-bench-134m}
DTYPE=${DTYPE:-bfloat16}
SCALE=${SCALE:-0.1}
THREADS=${THREADS:-1}
OUT=results/bench
mkdir -p "$OUT" docs/img
common=(--model "$MODEL" --num-threads "$THREADS" --dataset sharegpt --no-progress)

# 1. Batch timeline: a run whose Gantt chart stays readable (48 requests, 16 slots).
python -m iterserve.bench.cli offline "${common[@]}" --dtype "$DTYPE" --length-scale "$SCALE" \
  --num-prompts 48 --max-num-seqs 16 --policies static,continuous \
  --result-file "$OUT/timeline.json" --record-steps "$OUT/steps"
python -m iterserve.bench.plot timeline "$OUT/timeline.json" --out docs/img/timeline_static_vs_continuous.png

# 2. Offline: 128 ShareGPT-shaped requests, all at once, through each policy (repeated).
for i in $(seq 1 "$REPEATS"); do
  uptime
  python -m iterserve.bench.cli offline "${common[@]}" --dtype "$DTYPE" --length-scale "$SCALE" \
    --num-prompts 128 --result-file "$OUT/offline_$i.json"
done
python benchmarks/median_table.py "$OUT"/offline_[0-9]*.json
python -m iterserve.bench.plot cdf "$OUT"/offline_1.json --out docs/img/offline_latency_cdf.png

# 3. Rate sweep, light load to overload (smaller requests to keep it under half an hour).
# Explicit rates: 'auto' scales them from one capacity run, which a busy shared box can skew.
python -m iterserve.bench.cli sweep "${common[@]}" --dtype "$DTYPE" --length-scale 0.05 \
  --num-prompts 32 --policies static,continuous --request-rates 0.25,0.5,1,1.5,2,3,inf \
  --goodput ttft:5000 tpot:500 --result-file "$OUT/sweep.json" --record-steps "$OUT/sweep_steps"
python -m iterserve.bench.plot curves "$OUT/sweep.json" --out docs/img/sweep_latency_vs_throughput.png
python -m iterserve.bench.plot cdf "$OUT/sweep.json" --rate 1 --out docs/img/sweep_latency_cdf.png
python -m iterserve.bench.plot timeline "$OUT/sweep.json" --rate 1 --out docs/img/timeline_sweep_rate1.png

# 4. Over HTTP: the Azure conversation trace against `iterserve serve`, each policy, repeated.
for i in $(seq 1 "$REPEATS"); do
  for policy in continuous static; do
    python -m iterserve.cli serve --model "$MODEL" --dtype "$DTYPE" --num-threads "$THREADS" \
      --policy "$policy" --port 8125 --disable-access-log > "$OUT/server_$policy.log" 2>&1 &
    server=$!
    for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8125/v1/models > /dev/null && break; sleep 1; done
    python -m iterserve.bench.cli serve --base-url http://127.0.0.1:8125 --dataset azure-conv \
      --length-scale 0.05 --time-scale 0.25 --num-prompts 60 --goodput ttft:2000 tpot:500 \
      --no-progress --label "$policy" --result-file "$OUT/serve_${policy}_$i.json"
    kill "$server"; wait "$server" || true
  done
done
