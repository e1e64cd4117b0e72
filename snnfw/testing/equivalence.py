"""The equivalence matrix: each strategy's run beside ``none``'s with the same microbatches.

Every case trains the quickstart's recipe (Adam at lr 3e-3, a global batch
of 32) on a tiny flavor of a family, or on a model of the user's own given by
import path (``OWN_MODELS``: the SEW network of ``examples/train_own_model.py``,
with the plans snnfw infers). A strategy with ``D`` data replicas of
``M`` microbatches each must compute what ``none`` computes with ``D x M``
microbatches. ``tests/test_guarantee.py`` asserts it in float64;
``benchmark/drift.py`` measures how far float32 rounding carries each case.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from snnfw.config import Config, build_config

OWN_MODELS = {  # models of the user's own, by import path, that the matrix trains beside the families
    "own_sew": {
        "builder": f"{Path(__file__).resolve().parents[2] / 'examples' / 'train_own_model.py'}:build",
        "input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN",
    },
}
FAMILIES = ("cifar10dvs_vgg", "spikformer", "sequence_mlp", "spiking_mlp", *OWN_MODELS)
HSDP = {"dp_replicate": 2, "dp_shard": 2}


@attrs.frozen
class Case:
    """One strategy layout: ``ranks`` processes, ``replicas`` data replicas of ``microbatches`` each."""

    name: str
    strategy: str
    ranks: int
    replicas: int
    microbatches: int
    sections: dict = attrs.field(factory=dict)

    @property
    def reference_microbatches(self) -> int:
        return self.replicas * self.microbatches


def _pipeline(schedule: str, virtual: int = 1, mesh: dict | None = None) -> dict:
    parallel = {"parallel": {"mesh": mesh}} if mesh else {}
    return {"pipeline": {"schedule": schedule, "virtual_stages": virtual}, **parallel}


def _composed(sizes: dict, microbatches: int = 1) -> Case:
    """A composed mesh (strategy ``mesh``): its data replicas are its dp_replicate x dp_shard ranks."""
    replicas = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
    name = "mesh-" + "-x-".join(f"{dim}{size}" for dim, size in sizes.items())
    return Case(name, "mesh", math.prod(sizes.values()), replicas, microbatches, {"parallel": {"mesh": sizes}})


MESH_CASES = (  # the pairings of the five dimensions at size 2 that no preset spells, and three-dimensional layouts
    _composed({"dp_replicate": 2, "tp": 2}),
    _composed({"tp": 2, "time": 2}),
    _composed({"pp": 2, "dp_shard": 2}, 2),
    _composed({"pp": 2, "tp": 2}, 2),
    _composed({"pp": 2, "time": 2}, 2),
    _composed({"tp": 2, "time": 2, "dp_shard": 2}),
    _composed({"pp": 2, "dp_shard": 2, "tp": 2}, 2),
    _composed({"pp": 2, "dp_replicate": 2, "time": 2}, 2),
)
CASES = (
    Case("dp", "dp", 2, 2, 1),
    Case("zero", "zero", 2, 2, 1),
    Case("fsdp2", "fsdp2", 2, 2, 1),
    Case("hsdp", "fsdp2", 4, 4, 1, {"parallel": {"mesh": HSDP}}),
    Case("tp", "tp", 2, 1, 1),
    Case("fsdp2_tp", "fsdp2_tp", 4, 2, 1, {"parallel": {"mesh": {"dp": 2, "tp": 2}}}),
    Case("pp-gpipe", "pp", 2, 1, 4, _pipeline("gpipe")),
    Case("pp-1f1b", "pp", 2, 1, 4, _pipeline("1f1b")),
    Case("pp-interleaved", "pp", 2, 1, 4, _pipeline("interleaved", 2)),
    Case("pp-zero_bubble", "pp", 2, 1, 4, _pipeline("zero_bubble", 2)),
    Case("pp-looped_bfs", "pp", 2, 1, 4, _pipeline("looped_bfs", 2)),
    Case("pp-zbv", "pp", 2, 1, 4, _pipeline("zbv", 2)),
    Case("pp-dualpipev", "pp", 2, 1, 4, _pipeline("dualpipev", 2)),
    Case("pp-x-dp", "pp", 4, 2, 2, _pipeline("1f1b", mesh={"dp": 2, "pp": 2})),
    Case("tsp", "tsp", 2, 1, 1),
    Case("tsp-4", "tsp", 4, 1, 1, {"parallel": {"mesh": {"time": 4}}}),
    Case("dp-x-tsp", "tsp", 4, 2, 1, {"parallel": {"mesh": {"dp": 2, "time": 2}}}),
    Case("fsdp2-x-tsp", "fsdp2_tsp", 4, 2, 1, {"parallel": {"mesh": {"time": 2, "dp": 2}}}),
    *MESH_CASES,
)  # the presets are meshes: hsdp, fsdp2_tp, pp-x-dp, dp-x-tsp and fsdp2-x-tsp are the other five pairings


def case_config(family: str, case: Case | None, dtype: str, steps: int = 20, train: dict | None = None,
                data: dict | None = None) -> Config:
    """The config of ``case`` on ``family`` (``None``: the ``none`` reference with one microbatch);
    ``train`` and ``data`` replace or add keys of the recipe (another optimizer, augmentation)."""
    strategy, microbatches, sections = ("none", 1, {}) if case is None else (case.strategy, case.microbatches, case.sections)
    data = {
        "model": {**OWN_MODELS.get(family, {"family": family, "flavor": "tiny"}), "time_steps": 4},
        "data": {"name": "synthetic_dvs", "batch_size": 32, "train_samples": 256, "test_samples": 64, **(data or {})},
        "train": {"steps": steps, "lr": 3e-3, "optimizer": "adam", "seed": 3, "dtype": dtype, "microbatches": microbatches,
                  **(train or {})},
        "parallel": {"strategy": strategy},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return build_config(data)


def reference_config(family: str, microbatches: int, dtype: str, steps: int = 20, train: dict | None = None,
                     data: dict | None = None) -> Config:
    """``none`` with ``microbatches``: what every case with as many replicas x microbatches must compute."""
    config = case_config(family, None, dtype, steps, train, data)
    return attrs.evolve(config, train=attrs.evolve(config.train, microbatches=microbatches))


def max_relative_difference(reference: list[float], losses: list[float]) -> float:
    """The largest ``|loss - reference| / |reference|`` over the steps."""
    if len(reference) != len(losses):
        raise ValueError(f"{len(losses)} losses against {len(reference)} reference losses")
    return max(abs(got - want) / abs(want) for got, want in zip(losses, reference))
