"""What a model-family plugin registers: named flavors that build multi-step models.

A model takes frames ``[N, T, C, H, W]`` and returns logits ``[T, N, classes]``
in SpikingJelly's multi-step mode; the core trains on the time-averaged logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs

if TYPE_CHECKING:
    from torch import nn

from snnfw.errors import UnknownNameError


@attrs.frozen
class Flavor:
    """One size of a family: its input frame shape ``(C, H, W)``, classes and builder.

    ``with_classes(n)``, where given, returns the builder of the same flavor with ``n``
    classes, so ``model.num_classes`` can follow a data set (DVS128 Gesture's 11).
    """

    input_shape: tuple[int, int, int]
    num_classes: int
    build: Callable[[], nn.Module]
    description: str = ""
    with_classes: Callable[[int], Callable[[], nn.Module]] | None = None


@attrs.frozen
class ModelFamily:
    name: str
    flavors: dict[str, Flavor]

    def flavor(self, name: str) -> Flavor:
        try:
            return self.flavors[name]
        except KeyError:
            raise UnknownNameError(
                f"model family {self.name!r} has no flavor {name!r}; flavors: {', '.join(sorted(self.flavors))}"
            ) from None
