"""The optional packages a setting needs, checked before any rank starts: installed, and as new as snnfw's calls."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata

from snnfw.errors import ConfigError

MINIMUM = {  # the oldest release that has what snnfw calls
    "tensorboard": "1.15",  # torch.utils.tensorboard's own floor
    "wandb": "0.10",  # wandb.init(mode=...)
    "nir": "1.0",  # nir.NIRGraph.from_list, nir.read and nir.write
}


def require(package: str, key: str, extra: str | None = None) -> None:
    """Refuses ``key`` (the setting that asks for ``package``) where the package is missing or older than
    ``MINIMUM``; ``extra`` names ``scripts/install.sh``'s SNNFW_EXTRAS that installs it."""
    floor = MINIMUM[package]
    install = f"`SNNFW_EXTRAS={extra} bash scripts/install.sh` (or pip install '{package}>={floor}')" if extra else \
        f"pip install '{package}>={floor}'"
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{key} needs the {package} package, which is not installed; run {install}, or remove {key}")
    installed = metadata.version(package)
    if _release(installed) < _release(floor):
        raise ConfigError(f"{key} needs {package} {floor} or newer, and {installed} is installed; run {install}")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"0.31.0rc1"`` -> ``(0, 31, 0)``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0].split("a")[0])[:3])
