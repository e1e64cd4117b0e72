"""What a model-family plugin registers: named flavors that build multi-step models.

A model takes frames ``[N, T, C, H, W]`` and returns logits ``[T, N, classes]``
in SpikingJelly's multi-step mode; the core trains on the time-averaged logits.
A language model takes token ids ``[N, T, S]`` (each token repeated over the
time steps) and returns logits ``[T, N, S, vocab]``, one per position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs

if TYPE_CHECKING:
    from torch import nn

from snnfw.errors import UnknownNameError


@attrs.frozen
class Flavor:
    """One size of a family: one time step's input shape (a frame's ``(C, H, W)``, a token sequence's ``(S,)``),
    classes (a language model's: its vocabulary) and builder.

    ``with_classes(n)``, where given, returns the builder of the same flavor with ``n``
    classes, so ``model.num_classes`` can follow a data set (DVS128 Gesture's 11).
    ``vocab``: where the model reads token ids (below ``vocab``) instead of frames.
    ``with_sequence_length(n)``, where given, returns the builder for sequences of ``n`` tokens
    (``model.sequence_length``). ``loss``: the ``train.loss`` the flavor trains with where the config names none.
    """

    input_shape: tuple[int, ...]
    num_classes: int
    build: Callable[[], nn.Module]
    description: str = ""
    with_classes: Callable[[int], Callable[[], nn.Module]] | None = None
    vocab: int | None = None
    with_sequence_length: Callable[[int], Callable[[], nn.Module]] | None = None
    loss: str | None = None

    def shape_for(self, sequence_length: int | None) -> tuple[int, ...]:
        """One time step's input shape, with ``model.sequence_length`` where it is set."""
        return self.input_shape if sequence_length is None else (sequence_length,)


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
