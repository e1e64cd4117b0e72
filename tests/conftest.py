import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snnfw.testing import tiny_config

GROUPS = ("unit", "distributed", "e2e", "guarantee")  # tests/<group>/: run one with python -m pytest -m <group>


def pytest_configure():
    """One intra-op thread in this process, in the ranks it forks and in the commands it starts, unless
    OMP_NUM_THREADS says otherwise: ranks that share the cores (as ``snnfw train`` shares them) then do not wait on
    each other's thread pools, and tiny in-process runs are no slower on one thread. With ranks of two threads each
    on 2 cores, four files of tests/distributed (test_pp, test_fsdp2, test_precision, test_eval) took 96 s, not 68 s."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "spiking_mlp_plugin"


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """pip-installs the example package into a folder put on sys.path and PYTHONPATH for the rest of the session:
    spawned ranks inherit the one, a launcher's ranks the other, so every process of a later run has it alike."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(EXAMPLE)],
        check=True, timeout=180,
    )
    before = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(target), before)))
    yield target
    sys.path.remove(str(target))
    if before is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = before
