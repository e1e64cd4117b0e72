"""Deprecated: 0.1.0's ``snnfw.optim``, now :mod:`snnfw.components.optim`; import from :mod:`snnfw.api`. Removed in 0.3.0."""

from snnfw.deprecation import moved_module

__getattr__ = moved_module(__name__, "snnfw.components.optim")
