#!/usr/bin/env bash
# Benchmarks every strategy on both families on this machine, in each precision, beside the plain
# PyTorch loop on the same device, precision, optimizer and microbatches, into a new results file;
# then prints the report and writes its table into docs/benchmarks.md (between its bench-table markers).
# `none` and `dp` alternate with their baselines REPEATS times, since a shared machine's speed
# drifts between runs; the report takes the median of the paired ratios. Each pair also runs
# `none` and `dp` with the fused LIF kernels (model.neuron_backend = "inductor").
# Usage: [REPEATS=5] [PRECISIONS="fp32 bf16"] [INTO=docs/benchmarks.md] bash benchmark/run_all.sh [--set overrides...]
# bf16 is left out, saying so, on a CPU without bf16 kernels (torch runs its convolutions on a slow path there).
set -euo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:-benchmark/results/run_all-$(date +%Y%m%d-%H%M%S).jsonl}
repeats=${REPEATS:-5}
precisions=${PRECISIONS:-fp32 bf16}
into=${INTO:-docs/benchmarks.md}
extra=("$@")
if ! python -c "import sys, torch; sys.exit(not (torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported()))"; then
  if [[ " $precisions " == *" bf16 "* ]]; then
    echo "bf16 left out: this CPU ($(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')) has no bf16 kernels" >&2
  fi
  precisions=${precisions//bf16/}
fi
run() { python -m snnfw bench examples/quickstart.toml --results "$results" --warmup 1 --steps 5 "$@" \
          --set data.test_samples=8 --set data.train_samples=256 "${extra[@]}"; }
for precision in $precisions; do
  for model in "model.family=cifar10dvs_vgg model.flavor=full data.batch_size=8" \
               "model.family=spikformer model.flavor=tiny data.batch_size=32"; do
    sets=(--set "train.precision=$precision"); for kv in $model; do sets+=(--set "$kv"); done
    for repeat in $(seq "$repeats"); do
      run --nproc 1 --baseline "${sets[@]}"
      run --nproc 1 "${sets[@]}" --set parallel.strategy=none
      run --nproc 2 --baseline "${sets[@]}"
      run --nproc 2 "${sets[@]}" --set parallel.strategy=dp
      run --nproc 1 "${sets[@]}" --set parallel.strategy=none --set model.neuron_backend=inductor
      run --nproc 2 "${sets[@]}" --set parallel.strategy=dp --set model.neuron_backend=inductor
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
done
python -m snnfw bench --report --results "$results" --chart "${results%.jsonl}.png" ${into:+--into "$into"}
