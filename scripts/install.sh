#!/usr/bin/env bash
# Installs snnfw and what it needs into the current Python environment.
#
#   bash scripts/install.sh          snnfw, torch's CPU build where no torch is installed, the extras
#   bash scripts/install.sh --test   the same, and the test tools (pytest, import-linter, torchft for parallel.fault_tolerance, tokenizers for BPE corpora; nir, snntorch and nirtorch,
#                                    with which a test reads snnfw's NIR export as another simulator does)
#
# torch: where none is installed, 2.13 from PyTorch's CPU index (PyPI's Linux wheel is the multi-gigabyte CUDA
# build). On a GPU machine install your CUDA build of torch first, or pass SNNFW_TORCH=skip; an installed torch is
# never replaced. SpikingJelly is installed last and without its declared dependencies: its neurons, layers,
# memopt and model zoo need none of torchvision, torchaudio or SciencePlots, which would pull a CUDA build of torch;
# installing it last keeps pip's dependency check from reporting those it left out. tonic is installed the same
# way, with what `import tonic` and snnfw's event paths (its readers, Denoise, ToFrame, the event augments) import:
# numpy, scipy, h5py, tqdm, typing-extensions, importRosbag and requests (imported by its data set modules, not
# declared); left out are librosa, for tonic's audio transforms only, which brings numba, llvmlite and
# scikit-learn (about 280 MB), and expelliarmus, which tonic 1.7 declares and never imports. Optional extras
# (SNNFW_EXTRAS, default "tensorboard,wandb,nir" for log.tensorboard, log.wandb and snnfw export --format
# nir; "none" for none).
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }

test_tools=()
for arg in "$@"; do
  case "$arg" in
    --test) test_tools=(pytest import-linter nir snntorch nirtorch torchft==0.2.0 tokenizers) ;;
    *) echo "install.sh: unknown argument $arg (use --test for the test tools)" >&2; exit 2 ;;
  esac
done

if [ "${SNNFW_TORCH:-}" != "skip" ] && ! python -c "import torch" 2>/dev/null; then
  if [ "$(uname -s)" = "Linux" ]; then
    cpu_index=https://download.pytorch.org/whl/cpu
    if python -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=10)" 2>/dev/null; then
      pip_install --extra-index-url "$cpu_index" "torch==2.13.0+cpu"
    else  # a mirror or wheel folder in pip's own configuration must hold the CPU build
      pip_install "torch==2.13.0+cpu" || { echo "install.sh: torch's CPU build was not found ($cpu_index is" \
        "unreachable); install torch yourself, then run this again" >&2; exit 1; }
    fi
  else
    pip_install "torch==2.13.0"  # macOS and Windows wheels on PyPI are CPU builds
  fi
fi
pip_install pluggy attrs loguru h5py packaging tqdm numpy scipy setuptools matplotlib pillow typing-extensions \
  importRosbag requests "${test_tools[@]}"
extras="${SNNFW_EXTRAS:-tensorboard,wandb,nir}"
if [ "$extras" != "none" ]; then
  pip_install ${extras//,/ }
fi
python -c "import spikingjelly" 2>/dev/null || pip_install --no-deps "spikingjelly==2.0.0"
pip_install --no-deps "tonic==1.7.0"
pip_install --no-deps --no-build-isolation -e .
