"""Faults on purpose, for testing restarts and timeouts; set through environment variables.

- ``SNNFW_TEST_CRASH_AT_STEP=k``: before step k, rank ``SNNFW_TEST_FAULT_RANK``
  (default 1) exits with status 1, on the launcher's first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` unset or 0).
- ``SNNFW_TEST_HANG_AT_STEP=k``: before step k, that rank stops answering.
"""

from __future__ import annotations

import os
import sys
import time


def inject(step: int, rank: int) -> None:
    """Called by every rank before each step (counted from 1)."""
    env = os.environ
    if rank != int(env.get("SNNFW_TEST_FAULT_RANK", "1")):
        return
    if env.get("SNNFW_TEST_CRASH_AT_STEP") == str(step) and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"[snnfw] test fault: rank {rank} exits before step {step}", file=sys.stderr, flush=True)
        os._exit(1)
    if env.get("SNNFW_TEST_HANG_AT_STEP") == str(step):
        print(f"[snnfw] test fault: rank {rank} stops answering before step {step}", file=sys.stderr, flush=True)
        time.sleep(3600)
