"""parallel.cpu_allocator: "retain" makes glibc's malloc keep freed blocks, so a step's tensors stop page-faulting."""

import json
import subprocess
import sys

import pytest

from snnfw.config import build_config
from snnfw.distributed import cpu_allocator
from snnfw.errors import ConfigError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins

# A fresh process writes a 16 MiB tensor, frees it and reports how much of it stayed resident. glibc by default
# maps such a block straight from the kernel and unmaps it on free (the next one is faulted in anew); "retain"
# keeps it in the process for reuse.
KEPT = """
import json, sys, torch
from snnfw.distributed import cpu_allocator
applied = cpu_allocator.apply(sys.argv[1], "cpu")
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
before = resident()
torch.empty(4 * 2**20).fill_(1)
print(json.dumps({"applied": applied, "kept_mib": (resident() - before) / 2**20}))
"""


def kept_after_free(choice):
    out = subprocess.run([sys.executable, "-c", KEPT, choice], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not cpu_allocator.glibc(), reason="the allocator setting is glibc's")
def test_retain_keeps_a_freed_block_that_glibc_gives_back():
    system, retain, auto = (kept_after_free(c) for c in ("system", "retain", "auto"))
    assert retain["applied"] == auto["applied"] == "retain" and system["applied"] == "system"
    assert system["kept_mib"] < 4 and retain["kept_mib"] >= 15 and auto["kept_mib"] >= 15  # measured: 1.3, 17.3


def test_retain_without_glibc_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(cpu_allocator.platform, "libc_ver", lambda: ("", ""))
    with pytest.raises(ConfigError, match='parallel.cpu_allocator = "retain" sets glibc\'s malloc'):
        prepare(build_config({"parallel": {"cpu_allocator": "retain"}}), 1, Plugins())
    assert cpu_allocator.resolve("auto", "cpu") == "system"


def test_auto_retains_on_cpu_runs_and_says_so_in_the_plan():
    plan = prepare(build_config({"parallel": {"device": "cpu"}}), 1, Plugins()).plan
    assert any(line.startswith("cpu_allocator retain") for line in plan.rationale) == cpu_allocator.glibc()
    assert cpu_allocator.resolve("auto", "cuda") == "system"
    with pytest.raises(ConfigError, match="'cpu_allocator' must be in"):
        build_config({"parallel": {"cpu_allocator": "jemalloc"}})
