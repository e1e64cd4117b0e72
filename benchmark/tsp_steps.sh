#!/usr/bin/env bash
# Temporal parallelism against none and tp on the CPU: the full VGG at T = 16, 4 samples a step, tsp (with its
# default wavefront slices) and tp on 2 and 4 ranks, recorded by snnfw bench into benchmark/results/tsp.jsonl.
#   bash benchmark/tsp_steps.sh [WARMUP STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
warmup="${1:-1}" steps="${2:-4}"
results=benchmark/results/tsp.jsonl
common=(--set model.flavor=\"full\" --set model.time_steps=16 --set data.batch_size=4 --set data.train_samples=64
        --set data.test_samples=4 --set parallel.device=\"cpu\" --warmup "$warmup" --steps "$steps" --results "$results")
run() { python -m snnfw bench examples/quickstart.toml "$@" "${common[@]}"; }
run --nproc 1 --set parallel.strategy=\"none\" --label none
for ranks in 2 4; do
  run --nproc "$ranks" --set parallel.strategy=\"tsp\" --set "parallel.mesh={time=$ranks}" --label "tsp-$ranks"
  run --nproc "$ranks" --set parallel.strategy=\"tp\" --set "parallel.mesh={tp=$ranks}" --label "tp-$ranks"
done
