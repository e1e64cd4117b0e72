"""snnfw: train multi-step spiking neural networks across many devices.

The core owns the flow analyze -> plan -> apply -> run; every parallelism,
model family, data set and pipeline schedule is a plugin found through the
``snnfw`` entry-point group. Plugins mark their hook implementations with
:data:`hookimpl`.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("snnfw")

__all__ = ["__version__", "hookimpl"]
