"""snnfw: train multi-step spiking neural networks across many devices.

The core owns the flow analyze -> plan -> apply -> run; every parallelism,
model family, data set and pipeline schedule is a plugin found through the
``snnfw`` entry-point group. Plugins mark their hook implementations with
:data:`hookimpl`.
"""

import logging

from snnfw.plugin.hookspecs import hookimpl

__version__ = "0.3.0"

# torch warns that Triton is absent each time a library (here
# SpikingJelly) registers a custom op on a machine without it; on CPU that is
# expected, and every rank repeating it hides the messages that matter.
logging.getLogger("torch._library.triton").addFilter(lambda record: "Triton not available" not in record.getMessage())

__all__ = ["Session", "__version__", "hookimpl", "start"]


def __getattr__(name: str):
    """``snnfw.start`` and ``snnfw.Session`` (the Python API), imported when first used: loading plugins stays fast."""
    if name in ("start", "Session"):
        from snnfw.run import session

        return getattr(session, name)
    raise AttributeError(f"module 'snnfw' has no attribute {name!r}")
