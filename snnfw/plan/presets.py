"""The strategy names as spellings of meshes: each preset is a composed mesh (:mod:`snnfw.plan.compose`) and, for
``zero``, a setting.

==========  =======================================  ==========================================
preset      mesh on W ranks                          ``parallel.mesh`` it also takes
==========  =======================================  ==========================================
dp          {dp_replicate = W}                       {dp = W}
zero        {dp_replicate = W}, parallel.zero        {dp = W}
fsdp2       {dp_shard = W}                           {dp = W}; {dp_replicate, dp_shard} (HSDP)
tp          {tp = W}                                 {tp = W}
fsdp2_tp    {dp_shard = W/2, tp = 2}                 {dp = D, tp = T}
pp          {pp = W}                                 {dp = D, pp = P}
tsp         {time = W}                               {dp = D, time = P}
fsdp2_tsp   {dp_shard = W/2, time = 2}               {dp = D, time = P}
==========  =======================================  ==========================================

A preset's ``parallel.mesh`` may be spelled with the dimension names of 0.2.0 (``dp`` standing for the preset's
data dimension, as in the table) or with today's; a mesh of today's names composes whatever else it names beside
the preset's own dimensions (``strategy = "dp"`` with ``{dp_replicate = 2, tp = 2}``). Planning a preset resolves
it here, then runs the one composition path; the plan keeps the name it was asked by (``Plan.preset``).
"""

from __future__ import annotations

import difflib

import attrs

from snnfw.config import COMPOSED, Config
from snnfw.errors import PlanError, UnknownNameError

AUTO = "auto"

Sizes = dict[str, int]


@attrs.frozen
class Preset:
    """A name's mesh: its own dimensions (``dims``, each of 2 ranks or more), the one 0.2.0's ``dp`` names
    (``data``), its mesh on a world of W ranks when ``parallel.mesh`` is not set, and the settings it adds."""

    name: str
    dims: tuple[str, ...]
    data: str | None
    default: object  # world size -> sizes
    settings: tuple[tuple[str, object], ...] = ()
    beside: tuple[str, ...] = ()  # the dimensions 0.2.0 took beside its own (fsdp2's dp_replicate: HSDP)

    def mesh(self, world: int, asked: tuple[tuple[str, int], ...] | None) -> Sizes:
        """The mesh in today's names: ``asked`` (``parallel.mesh``) translated, else the default on ``world``."""
        if not asked:
            return self.default(world)
        sizes: Sizes = {}
        for name, size in asked:
            if name == "dp":
                if self.data is None:
                    raise PlanError(f"strategy {self.name}'s parallel.mesh names dp, and {self.name} has no data "
                                    "dimension of its own; name dp_replicate (DistributedDataParallel) or dp_shard "
                                    f"(FSDP2) beside {', '.join(self.dims)}")
                name = self.data
            if name in sizes:
                raise PlanError(f"strategy {self.name}'s parallel.mesh names {name} twice (dp is {self.data}); "
                                "name it once")
            sizes[name] = size
        return sizes


def _one(dim: str):
    return lambda world: {dim: world}


def _halves(dim: str):
    return lambda world: {"dp_shard": max(world // 2, 1), dim: 2}


PRESETS = {preset.name: preset for preset in (
    Preset("dp", ("dp_replicate",), "dp_replicate", _one("dp_replicate")),
    Preset("zero", ("dp_replicate",), "dp_replicate", _one("dp_replicate"), (("parallel.zero", True),)),
    Preset("fsdp2", ("dp_shard",), "dp_shard", _one("dp_shard"), beside=("dp_replicate",)),
    Preset("tp", ("tp",), None, _one("tp")),
    Preset("fsdp2_tp", ("dp_shard", "tp"), "dp_shard", _halves("tp")),
    Preset("pp", ("pp",), "dp_replicate", _one("pp"), beside=("dp_replicate",)),
    Preset("tsp", ("time",), "dp_replicate", _one("time"), beside=("dp_replicate",)),
    Preset("fsdp2_tsp", ("dp_shard", "time"), "dp_shard", _halves("time")),
)}


def resolve(config: Config, world: int) -> Config:
    """``config`` with its preset (``parallel.strategy``) resolved to a composed mesh; a config that names no preset
    as it is."""
    preset = PRESETS.get(config.parallel.strategy)
    if preset is None:
        return config
    if world < 2:
        raise PlanError(f"strategy {preset.name} needs at least 2 ranks, and the run has {world}; launch with "
                        "--nproc 2 or more, or use strategy none")
    sizes = preset.mesh(world, config.parallel.mesh)
    missing = [dim for dim in preset.dims if dim not in sizes]
    short = [f"{dim} = {sizes[dim]}" for dim in preset.dims if dim in sizes and sizes[dim] < 2]
    if missing or short:
        if missing:
            found, fix = f"its mesh {_spelled(sizes)} names no {' or '.join(missing)}", "add it"
        elif config.parallel.mesh:
            found, fix = f"its mesh has {', '.join(short)}", "set each to 2 or more"
        else:
            found, fix = f"{world} ranks give it {', '.join(short)}", f"launch with --nproc {2 ** len(preset.dims)} or more"
        raise PlanError(f"strategy {preset.name} splits over {' and '.join(preset.dims)}, 2 ranks or more each, and "
                        f"{found}; {fix}, or set parallel.strategy = \"mesh\" to compose the dimensions parallel.mesh names")
    for key, value in preset.settings:
        section, name = key.split(".")
        if key in config.explicit and (set_value := _value(config, key)) != value:
            raise PlanError(f"strategy {preset.name} is {_spelled(sizes)} with {key} = {str(value).lower()}, and the "
                            f"config sets {key} = {str(set_value).lower()}; remove it, "
                            f"or use strategy {'dp' if preset.name == 'zero' else 'mesh'}")
        config = config.with_section(section, attrs.evolve(getattr(config, section), **{name: value}))
    parallel = attrs.evolve(config.parallel, strategy=COMPOSED, mesh=tuple(sizes.items()))
    explicit = config.explicit | {"parallel.mesh"} | {key for key, _ in preset.settings}
    return attrs.evolve(config.with_section("parallel", parallel), explicit=explicit)


def name_of(mesh, config: Config) -> str | None:
    """The preset whose layout ``mesh`` is (its dimensions, those it takes beside them, its settings), or None:
    what a plan is called whichever way its config spelled it."""
    dims = {name for name, size in mesh if size > 1}
    for preset in sorted(PRESETS.values(), key=lambda p: -len(p.settings)):  # zero before dp
        if set(preset.dims) <= dims <= {*preset.dims, *preset.beside} and \
                all(_value(config, key) == value for key, value in preset.settings):
            return preset.name
    return None


def _value(config: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name, None)


def check_name(name: str, plugins) -> None:
    """Refuses a strategy name that is neither registered, a preset nor ``auto``, naming the closest."""
    registered = plugins.strategies.names()
    if name in registered or name in PRESETS or name == AUTO:
        return
    known = sorted({*registered, *PRESETS}) + [AUTO]
    close = difflib.get_close_matches(str(name), known, n=1)
    raise UnknownNameError(f"unknown strategy {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                           + f"; strategies and presets: {', '.join(known)}"
                           + "".join(f"; plugin {failure}, and may be the one that registers it: fix or uninstall it"
                                     for failure in plugins.strategies.failed))


def spelled_mesh(strategy: str, mesh: dict) -> dict:
    """A plan's mesh as written by snnfw 0.2.0 under a preset (``{"dp": 2, "tp": 2}`` of ``fsdp2_tp``) in today's
    names; any other mesh as it is."""
    preset = PRESETS.get(strategy)
    return preset.mesh(0, tuple(mesh.items())) if preset and "dp" in mesh else dict(mesh)


def _spelled(sizes: Sizes) -> str:
    return "{" + ", ".join(f"{d} = {n}" for d, n in sizes.items()) + "}"
