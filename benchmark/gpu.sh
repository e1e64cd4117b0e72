#!/usr/bin/env bash
# Every GPU setting snnfw offers on the GPUs of this host, within about 10 minutes on one GPU:
# neuron backends, compile, bf16/fp16, memopt 1-4, and every strategy the GPU count fits, beside
# the plain PyTorch loop; CUDA allocator peaks. Prints the table, writes the JSONL.
# Usage: bash benchmark/gpu.sh [--dry] [--gpus N] [--budget-s S] [--only CASE,...] [--anchors]
# --anchors: SpikingJelly 2.0's published cases (CIFAR10-DVS VGG, 16 a rank, T = 10) with its RTX 4090 times beside.
# --dry (automatic without CUDA): the same cases on the CPU with tiny shapes, to prove the script runs.
# bash benchmark/gpu.sh --guarantee [--dry] [--only CASE,...]: every strategy on CUDA against none in float64
# (benchmark/gpu_guarantee.py), within about 8 minutes on one GPU, each result in a JSONL as it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmark/gpu.py "$@"
