import subprocess
import sys
from pathlib import Path

import pytest

from snnfw.config import build_config

TINY = {
    "model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4},
    "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 64, "test_samples": 16},
    "train": {"steps": 3, "lr": 0.01, "seed": 3},
}


def tiny_config(strategy="none", microbatches=1, **sections):
    data = {k: dict(v) for k, v in TINY.items()}
    data["parallel"] = {"strategy": strategy, "device": "cpu"}  # unless a test asks for CUDA
    data["train"]["microbatches"] = microbatches
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    if data["data"]["name"] != "synthetic_dvs":  # an on-disk set has the samples its files hold
        del data["data"]["train_samples"], data["data"]["test_samples"]
    return build_config(data)


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture(scope="module")
def one_thread():
    """In-process runs on one thread, which is faster than two on a shared 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(threads)


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "spiking_mlp_plugin"


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """pip-installs the example package into a folder put on sys.path (spawned ranks inherit it)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(EXAMPLE)],
        check=True, timeout=180,
    )
    sys.path.insert(0, str(target))
    yield target
    sys.path.remove(str(target))
