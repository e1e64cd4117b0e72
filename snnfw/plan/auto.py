"""``parallel.strategy = "auto"``: every strategy plugin proposes, the preference ranks.

Strategy plugins answer ``snnfw_plan`` for ``auto`` as for their own name,
attaching an :class:`snnfw.plan.estimate.Estimate`; so a third-party strategy takes
part without any change here. ``speed`` ranks by :mod:`snnfw.plan.cost_model`'s
predicted step time, from the strategies' own byte estimates, over the links ``snnfw tune`` probed and with
the corrections it learned where ``parallel.tune_results`` names its records (else assumed links, uncorrected;
``tune`` also counts the bytes by dry run and measures). Candidates that cannot run are kept with their
reason, for ``snnfw plan`` to show.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import torch

from snnfw.config import COMPOSED, Config, with_settings
from snnfw.errors import PlanError
from snnfw.plan import cost_model, proxy
from snnfw.plan.estimate import measure_cost
from snnfw.plan.presets import name_of

AUTO = "auto"


@attrs.frozen
class Candidate:
    strategy: str
    mesh: dict
    replicas: int = 1
    estimate: object = None
    reason: str | None = None  # why it cannot run
    settings: tuple = ()  # config values it runs with, as in snnfw.plan.layout.Proposal
    predicted_ms: float = 0.0  # the cost model's step time (snnfw.plan.cost_model)
    preset: str | None = None  # the preset whose layout it is (snnfw.plan.presets.name_of)

    @property
    def name(self) -> str:
        """The preset the candidate's layout is, else its strategy (``mesh``)."""
        return self.preset or self.strategy

    @property
    def assignments(self) -> str:
        """The candidate as config lines: ``parallel.strategy = "pp", parallel.mesh = {pp = 4},
        pipeline.schedule = "zbv"``."""
        pairs = [f"parallel.strategy = {json.dumps(self.name)}"]
        if self.mesh:
            pairs.append(f"parallel.mesh = {self._mesh}")
        return ", ".join([*pairs, *(f"{key} = {json.dumps(value)}" for key, value in self.settings)])

    @property
    def _mesh(self) -> str:
        return "{" + ", ".join(f"{d} = {n}" for d, n in self.mesh.items()) + "}"

    def overrides(self) -> list[str]:
        """The candidate as ``--set`` overrides: strategy, mesh and settings."""
        return [f"parallel.strategy={self.name}", f"parallel.mesh={self._mesh}",
                *(f"{k}={json.dumps(v)}" for k, v in self.settings)]

    def describe(self, device_type: str) -> str:
        settings = "".join(f", {key} = {value!r}" for key, value in self.settings)
        mesh = " x ".join(f"{d}={n}" for d, n in self.mesh.items())
        if self.reason:
            shown = ", ".join(filter(None, (mesh, settings[2:])))
            return f"{self.name}{shown and f' ({shown})'}: cannot run: {self.reason}"
        return f"{self.name} ({mesh}{settings}): ~{self.predicted_ms:.1f} ms/step predicted, {self.estimate.summary()}"


def candidates(request, proposals) -> tuple[list[Candidate], list[Candidate]]:
    """Splits proposals into runnable candidates and refused ones, with reasons.

    A refusal without settings or a mesh refuses its strategy, whichever plugin gives it, as
    when the strategy is named; one with a mesh and no settings refuses the strategy on that mesh; one with
    settings refuses only that variant.
    """
    config, topology = request.config, request.topology
    memory = topology.memory_per_rank()
    cluster, corrections = learned(config, topology)
    vetoed = {p.strategy for p in proposals if p.refusal and not p.settings and not p.mesh}
    vetoed_meshes = {(p.strategy, frozenset(p.mesh)) for p in proposals if p.refusal and not p.settings and p.mesh}
    feasible, refused = [], []
    for p in proposals:
        mesh = dict(p.mesh)
        preset = name_of(p.mesh, with_settings(config, dict(p.settings))[0]) if p.strategy == COMPOSED else None
        if p.refusal or p.estimate is None:
            refused.append(Candidate(p.strategy, mesh, reason=p.refusal or "it gives no estimate", settings=p.settings,
                                     preset=preset))
            continue
        if p.strategy in vetoed or (p.strategy, frozenset(p.mesh)) in vetoed_meshes:
            continue
        replicas = p.replicas
        micro = config.train.microbatches or p.microbatches or 1
        if config.data.batch_size % (replicas * micro):
            reason = f"data.batch_size {config.data.batch_size} is not divisible by {replicas} x {micro}"
        elif p.estimate.memory_bytes > memory:
            reason = f"needs ~{p.estimate.memory_bytes / 2**30:.1f} GiB per rank, has {memory / 2**30:.1f}"
        else:
            terms = cost_model.terms_of(p.strategy, p.estimate, request.cost, tuple(mesh))
            feasible.append(Candidate(p.strategy, mesh, replicas, p.estimate, settings=p.settings,
                                      predicted_ms=cost_model.predict(terms, cluster, corrections).ms, preset=preset))
            continue
        refused.append(Candidate(p.strategy, mesh, reason=reason, settings=p.settings, preset=preset))
    return feasible, _collapse(refused)


def learned(config: Config, topology) -> tuple[cost_model.Cluster, cost_model.Corrections]:
    """The links and corrections the cost model predicts with: what ``snnfw tune`` learned beside
    ``parallel.tune_results`` where it is set, else the assumed links, uncorrected."""
    if config.parallel.tune_results is not None:
        return cost_model.learned(Path(config.parallel.tune_results), topology.device_type, topology.world_size)
    cluster = cost_model.Cluster.here(topology.device_type, topology.world_size)
    return cluster, cost_model.Corrections(cluster.device)


def _collapse(refused: list[Candidate]) -> list[Candidate]:
    """One refusal per strategy (or preset) and reason: variants and meshes refused alike lose their settings and
    mesh."""
    kept: dict[tuple, Candidate] = {}
    for c in refused:
        key = (c.name, c.reason)
        kept[key] = attrs.evolve(c, settings=(), mesh={}) if key in kept else c
    return list(kept.values())


def rank(feasible: list[Candidate], prefer: str, memory: float) -> list[Candidate]:
    """Best first: fastest by the cost model (speed), least memory per rank (memory), largest batch that fits
    (capacity)."""
    keys = {
        "speed": lambda c: (c.predicted_ms, c.estimate.memory_bytes),
        "memory": lambda c: (c.estimate.memory_bytes, c.predicted_ms),
        "capacity": lambda c: (-c.estimate.capacity(memory, c.replicas), c.predicted_ms),
    }
    return sorted(feasible, key=keys[prefer])


def example_batch(spec, samples: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    frames = (torch.rand(samples, spec.time_steps, *spec.shape, generator=generator) < 0.1).float()
    return frames, torch.zeros(samples, *spec.label_shape, dtype=torch.long)


SHOWN_REFUSALS = 12


def refusal_summary(refused: list[Candidate], device_type: str) -> str:
    """The refusals, the first of each kind (a strategy's reason up to its first colon, the dimension refusing, with
    its numbers left out: the same refusal on other sizes or settings), at most ``SHOWN_REFUSALS``, and how many
    more there were."""
    kinds: dict[tuple[str, str], Candidate] = {}
    for c in refused:
        kinds.setdefault((c.name, re.sub(r"\d+", "#", (c.reason or "").split(":")[0])), c)
    shown = [c.describe(device_type) for c in list(kinds.values())[:SHOWN_REFUSALS]]
    more = len(refused) - len(shown)
    return "; ".join(shown) + (f"; and {more} more refusal(s) of these kinds on other sizes or settings" if more else "")


def ranked_candidates(request, plugins) -> tuple[list[Candidate], list[Candidate]]:
    """(runnable candidates, best first under ``parallel.prefer``; refused candidates).

    A refusal of ``auto`` itself (a setting no strategy can run) refuses the request at once.
    """
    topology = request.topology
    proposals = plugins.propose(request)
    if refusals := [p.refusal for p in proposals if p.strategy == AUTO and p.refusal]:
        raise PlanError(f"strategy {AUTO!r} cannot run: {'; '.join(refusals)}")
    feasible, refused = candidates(request, [p for p in proposals if p.strategy != AUTO])
    if not feasible:
        reasons = refusal_summary(refused, topology.device_type) or "no strategy plugin proposed a plan"
        raise PlanError(f"auto found no strategy that can run on {topology.world_size} rank(s): {reasons}")
    memory = topology.memory_per_rank()
    return rank(feasible, request.config.parallel.prefer or "speed", memory), refused


@attrs.frozen
class Decision:
    """``auto``'s choice: made once, from one measurement, and applied alike by every rank (the launcher's plan file
    carries it; ranks that plan for themselves take rank 0's)."""

    strategy: str
    mesh: tuple[tuple[str, int], ...]
    settings: tuple[tuple[str, object], ...]
    rationale: tuple[str, ...]

    def applied(self, config: Config) -> Config:
        """``config`` with the chosen strategy, mesh and settings (the keys the user set are kept)."""
        parallel = attrs.evolve(config.parallel, strategy=self.strategy, mesh=self.mesh)
        return with_settings(attrs.evolve(config, parallel=parallel), dict(self.settings))[0]


def choose(request, plugins) -> Decision:
    """The best candidate under ``parallel.prefer``, with the rationale that lists the others."""
    prefer = request.config.parallel.prefer or "speed"
    device = request.topology.device_type
    ranked, refused = ranked_candidates(request, plugins)
    best = ranked[0]
    rationale = (
        f"auto, prefer {prefer}: chose {best.describe(device)}",
        *(f"candidate {c.describe(device)}" for c in ranked[1:]),
        *(f"candidate {c.describe(device)}" for c in refused),
    )
    return Decision(best.strategy, tuple(best.mesh.items()), tuple(best.settings), rationale)


MEASURE_COPIES = 4  # what a measured step holds beside the model: its copy, gradients, and Adam's two states


def check_measurable(model, why: str = "") -> None:
    """Refuses a model whose measured step would not fit this host's available memory (the process would be killed
    with no word): the cost is measured on one step of a copy of the model, here."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    if not _fits(model):
        raise PlanError(f"auto measures one training step of the model on this host, which holds {held / 2**30:.1f} "
                        f"GiB of parameters and would need ~{MEASURE_COPIES * held / 2**30:.1f} GiB, and this host has "
                        f"{_available_memory() / 2**30:.1f} GiB available{why}; name the layout (parallel.mesh) and "
                        "check it with snnfw plan --dry-run, or run auto where the model's step fits")


def _fits(model) -> bool:
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    available = _available_memory()
    return available is None or MEASURE_COPIES * held <= available


def _available_memory() -> int | None:
    """The bytes this host can still give (Linux's MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(model, spec, plugins, train, threads: int | None = None, transform=None, blocks: tuple[str, ...] = ()):
    """The per-sample cost of ``model`` that estimates scale from, with a step of ``train.optimizer``, under
    ``train.precision``, at ``threads`` threads (default: this process's), transformed by ``transform(model,
    example)`` where given (:func:`snnfw.plan.estimate.measure_cost`). A model whose step does not fit this host is
    measured through proxies with fewer of its repeated ``blocks`` (:mod:`snnfw.plan.proxy`), where it has them."""
    from snnfw.components.optim import optimizer_options
    from snnfw.components.precision import autocast

    frames, labels = example_batch(spec)

    def optimizer(parameters):
        optimizer_class, options = optimizer_options(train, plugins, parameters)
        return optimizer_class(parameters, **options)

    def cost_of(measured):
        return measure_cost(measured, frames, labels, plugins.reset_state, optimizer, threads,
                            precision=lambda: autocast(train, next(measured.parameters(), frames).device.type),
                            transform=transform)

    if _fits(model):
        return cost_of(model)
    run = proxy.repeated_blocks(model, blocks)
    if run is None:
        check_measurable(model, " (nor has it a run of identical blocks to measure a smaller copy of)")
    measured = proxy.proxy(model, run, 2)
    check_measurable(measured, f" for a copy with {run.describe()}")
    del measured
    return proxy.extrapolated(model, run, cost_of, spec.time_steps, spec.shape, plugins.reset_state)
