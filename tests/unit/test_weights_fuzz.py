"""A fuzz of weights files: a real state dict cut short, bit-flipped, emptied, replaced by text, another type,
wrong shapes or NaN is either loaded or refused with a user error, never another exception."""

import math
import random

import pytest
import torch

from snnfw.components.weights import load_weights, read_weights
from snnfw.errors import CheckpointError
from snnfw.plan.prepare import build_model
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config
from snnfw.testing.checks import user_outcome

TRIES = 120


def _mutations(state: dict, data: bytes, rng: random.Random):
    name = rng.choice(sorted(state))
    flips = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        flips[rng.randrange(len(flips))] ^= 1 << rng.randrange(8)
    shape = dict(state)
    shape[name] = torch.zeros(*[n + 1 for n in state[name].shape]) if state[name].dim() else torch.zeros(2)
    nan = dict(state)
    nan[name] = torch.full_like(state[name], math.nan) if state[name].is_floating_point() else state[name]
    return rng.choice([
        ("cut", data[: rng.randrange(len(data))]), ("bits", bytes(flips)), ("empty", b""), ("text", b"weights = 1\n"),
        ("list", list(state.values())), ("not tensors", {k: 1.0 for k in state}), ("shape", shape), ("nan", nan),
    ])


def test_mutated_weights_files_load_or_are_refused_with_a_user_error(tmp_path):
    model, _ = build_model(tiny_config(), Plugins())
    state = model.state_dict()
    path = tmp_path / "whole.pt"
    torch.save(state, path)
    data, rng, outcomes = path.read_bytes(), random.Random(0), {"done": 0, "refused": 0}
    for attempt in range(TRIES):
        kind, mutated = _mutations(state, data, rng)
        target = tmp_path / f"{attempt}.pt"
        if isinstance(mutated, bytes):
            target.write_bytes(mutated)
        else:
            torch.save(mutated, target)
        outcomes[user_outcome(lambda: load_weights(model, read_weights(target)), f"{kind} mutation")] += 1
    print(f"weights fuzz: {TRIES} mutated files, {outcomes}")
    assert outcomes["refused"] > TRIES / 2


def test_a_file_of_python_objects_is_refused_without_advice_to_unpickle_it(tmp_path):
    torch.save({"layer": torch.nn.Linear(2, 2)}, tmp_path / "module.pt")
    (tmp_path / "text.pt").write_text("weights = 1\n")
    refusals = {}
    for name in ("module.pt", "text.pt"):
        with pytest.raises(CheckpointError) as refused:
            read_weights(tmp_path / name)
        refusals[name] = str(refused.value)
    assert "it holds torch.nn.modules.linear.Linear, not only tensors, and snnfw does not unpickle code" in (
        refusals["module.pt"])
    assert "not a torch file, or cut short" in refusals["text.pt"]
    assert not any("weights_only" in text or "trust" in text for text in refusals.values())
