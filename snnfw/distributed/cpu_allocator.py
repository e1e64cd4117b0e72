"""``parallel.cpu_allocator``: whether a rank's malloc keeps the memory torch frees, for the next step.

torch's CPU tensors come from the C library's malloc. glibc's serves a block
above its mmap threshold (128 KiB at first, rising to the size of blocks
freed, up to 32 MiB) straight from the kernel and returns it on free, and
gives the heap's free top back to the kernel; so a training step's
activations and gradients, a few MiB each, are page-faulted and zeroed
again at every step. ``retain`` sets the threshold to its largest and turns
trimming off: freed blocks stay in the process and the next step reuses
them (the CIFAR10DVSVGG step 12% faster in bf16 and 5% in fp32 on a CPU
with AMX, at the same peak; README, Config). ``system`` leaves malloc as it
is; ``auto`` is ``retain`` on CPU runs under glibc, ``system`` elsewhere.
The same settings as glibc's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_``, made in the running process, so a ``torchrun``
launch gets them too. They hold for the rest of the process: a later
``system`` does not undo an earlier ``retain``.
"""

from __future__ import annotations

import ctypes
import platform

from snnfw.errors import ConfigError

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit: larger blocks are still mapped
_NO_TRIM = 2**31 - 1  # mallopt takes an int: the heap's free top is kept up to 2 GiB


def glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def resolve(choice: str, device_type: str) -> str:
    """``retain`` or ``system``; ``retain`` without glibc's malloc is refused."""
    if choice == "retain" and not glibc():
        raise ConfigError(
            f'parallel.cpu_allocator = "retain" sets glibc\'s malloc, and this system runs {platform.system()} '
            f"with {platform.libc_ver()[0] or 'another C library'}; remove it or set \"auto\" or \"system\""
        )
    if choice == "auto":
        return "retain" if device_type == "cpu" and glibc() else "system"
    return choice


def apply(choice: str, device_type: str) -> str:
    """Sets this process's malloc as ``choice`` resolves on ``device_type``; returns what was applied."""
    applied = resolve(choice, device_type)
    if applied == "retain":
        libc = ctypes.CDLL(None)
        if not (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, _NO_TRIM)):
            raise RuntimeError("glibc's mallopt refused parallel.cpu_allocator = \"retain\"'s settings")
    return applied
