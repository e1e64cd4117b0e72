#!/usr/bin/env bash
# Installs snnfw and what it needs into the current Python environment.
#
# torch is pinned to the CPU build that this project is tested with. SpikingJelly
# is installed without its declared dependencies: its neurons, layers, memopt and
# model zoo need none of torchvision, torchaudio or tensorboard, which would pull
# a multi-gigabyte CUDA build of torch. On a GPU machine install your own torch
# first and pass SNNFW_TORCH=skip. Optional extras (SNNFW_EXTRAS, default "tensorboard,wandb"
# for log.tensorboard and log.wandb; "none" for none) are installed last.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }
if [ "${SNNFW_TORCH:-}" != "skip" ]; then
  python -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
fi
pip_install pluggy attrs pytest import-linter loguru h5py packaging tqdm numpy scipy setuptools matplotlib "tonic==1.7.0"
python -c "import spikingjelly" 2>/dev/null || pip_install --no-deps "spikingjelly==2.0.0"
pip_install --no-deps --no-build-isolation -e .
extras="${SNNFW_EXTRAS:-tensorboard,wandb}"
if [ "$extras" != "none" ]; then
  pip_install ${extras//,/ }
fi
