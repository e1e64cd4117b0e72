"""parallel.cpu_allocator: "retain" makes glibc's malloc keep freed blocks, so a step's tensors stop page-faulting."""

import json
import subprocess
import sys

import pytest

from snnfw import cpu_allocator
from snnfw.config import build_config
from snnfw.errors import ConfigError
from snnfw.plugins import Plugins
from snnfw.prepare import prepare

# A fresh process holds 16 tensors of 4 MiB at once, written, then frees them, five times (as a step's
# activations are held and freed), and counts the page faults of the last four rounds: the ones every step
# would pay again.
FAULTS = """
import json, resource, sys, torch
from snnfw import cpu_allocator
applied = cpu_allocator.apply(sys.argv[1], "cpu")
step = lambda: [torch.empty(2**20).fill_(1) for _ in range(16)]
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(choice):
    out = subprocess.run([sys.executable, "-c", FAULTS, choice], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not cpu_allocator.glibc(), reason="the allocator setting is glibc's")
def test_retain_reuses_freed_blocks_where_glibc_maps_them_anew():
    system, retain, auto = faults("system"), faults("retain"), faults("auto")
    pages = 4 * 16 * 4 * 2**20 // 4096  # four rounds of 16 tensors of 4 MiB
    assert system["applied"] == "system" and system["faults"] >= 0.9 * pages  # the freed heap trimmed, faulted again
    assert retain["applied"] == auto["applied"] == "retain"
    assert retain["faults"] < 0.2 * pages and auto["faults"] < 0.2 * pages  # measured: 0.11


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
