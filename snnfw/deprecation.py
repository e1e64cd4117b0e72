"""The import paths of the last release that moved, kept for one more release with a ``DeprecationWarning``.

0.2.0 grouped the core by its flow (``snnfw.analysis`` became
``snnfw.model.analysis``, ``snnfw.plan`` a package, ...) and made
:mod:`snnfw.api` the one public import. A module of 0.1.0's path is a shim
(``__getattr__ = moved_module(__name__, new)``) whose names are the new
module's, the same objects; 0.3.0 removes the shims.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Callable

REMOVED_IN = "0.3.0"


def _message(old: str, new: str, names: str) -> str:
    return (f"{old} is deprecated since snnfw 0.2.0 and is removed in {REMOVED_IN}: import {names} from snnfw.api "
            f"(it is now {new}, internal)")


def moved_module(old: str, new: str) -> Callable[[str], Any]:
    """Warns that module ``old`` (being imported) moved to ``new``; returns the ``__getattr__`` that gives ``new``'s
    names. The warning points at the import of ``old``."""
    warnings.warn(_message(old, new, "its public names"), DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)

    def __getattr__(name: str) -> Any:
        return getattr(module, name)

    return __getattr__


def moved_names(package: str, new: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package that 0.1.0's module of the same path became: ``package.NAME``, for each of
    ``names``, is ``new``'s, with a warning the first time it is looked up (then it is the package's own)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(_message(f"{package}.{name}", f"{new}.{name}", name), DeprecationWarning, stacklevel=2)
        value = getattr(importlib.import_module(new), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
