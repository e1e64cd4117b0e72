import subprocess
import sys
from pathlib import Path

import pytest

from snnfw.testing import tiny_config

GROUPS = ("unit", "distributed", "e2e", "guarantee")  # tests/<group>/: run one with python -m pytest -m <group>


def pytest_collection_modifyitems(items):
    """Marks each test with its folder's group."""
    for item in items:
        group = item.path.parent.name
        if group in GROUPS:
            item.add_marker(group)


@pytest.fixture
def faults(monkeypatch):
    """Loads the fault plugin (snnfw.testing.faults) in this process and every rank it starts; the SNNFW_TEST_*
    variables a test sets then say which fault."""
    monkeypatch.setenv("SNNFW_PLUGINS", "snnfw.testing.faults")


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
