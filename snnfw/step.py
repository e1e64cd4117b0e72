"""Deprecated: 0.1.0's ``snnfw.step``, now :mod:`snnfw.components.step`; import from :mod:`snnfw.api`. Removed in 0.3.0."""

from snnfw.deprecation import moved_module

__getattr__ = moved_module(__name__, "snnfw.components.step")
