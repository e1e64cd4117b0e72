"""Deprecated: 0.1.0's ``snnfw.metrics``, now :mod:`snnfw.components.metrics`; import from :mod:`snnfw.api`. Removed in 0.3.0."""

from snnfw.deprecation import moved_module

__getattr__ = moved_module(__name__, "snnfw.components.metrics")
