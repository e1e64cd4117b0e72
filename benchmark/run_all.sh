#!/usr/bin/env bash
# Benchmarks every strategy on both families on this machine, plus the plain
# PyTorch baselines, into a new results file, then prints the report.
# `none` and `dp` alternate with their baselines three times, since a shared
# machine's speed drifts between runs; the report takes medians.
# Usage: bash benchmark/run_all.sh [extra --set overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:-benchmark/results/run_all-$(date +%Y%m%d-%H%M%S).jsonl}
extra=("$@")
run() { python -m snnfw bench examples/quickstart.toml --results "$results" --warmup 1 --steps 5 "$@" \
          --set data.test_samples=8 --set data.train_samples=256 "${extra[@]}"; }
for model in "model.family=cifar10dvs_vgg model.flavor=full data.batch_size=8" \
             "model.family=spikformer model.flavor=tiny data.batch_size=32"; do
  sets=(); for kv in $model; do sets+=(--set "$kv"); done
  for repeat in 1 2 3; do
    run --nproc 1 --baseline "${sets[@]}"
    run --nproc 1 "${sets[@]}" --set parallel.strategy=none
    run --nproc 2 --baseline "${sets[@]}"
    run --nproc 2 "${sets[@]}" --set parallel.strategy=dp
  done
  for strategy in zero tp fsdp2; do
    run --nproc 2 "${sets[@]}" --set parallel.strategy=$strategy
  done
  run --nproc 4 "${sets[@]}" --set parallel.strategy=fsdp2_tp
  for schedule in gpipe 1f1b; do
    run --nproc 2 "${sets[@]}" --set parallel.strategy=pp --set pipeline.schedule=$schedule --set train.microbatches=4
  done
  run --nproc 2 "${sets[@]}" --set parallel.strategy=pp --set pipeline.schedule=interleaved \
      --set pipeline.virtual_stages=2 --set train.microbatches=4
done
python -m snnfw bench --report --results "$results" --chart "${results%.jsonl}.png"
