"""Composed meshes: ``parallel.mesh`` alone names a size per dimension, and the strategy owning each dimension
applies its part, in one order, so that any mix the model allows trains (strategy ``mesh``:
:mod:`snnfw.plan.composed`).

A dimension is owned by the strategy whose :attr:`~snnfw.plugin.strategy.Strategy.dimension` names it
(built in: ``dp_replicate``, ``dp_shard``, ``tp``, ``pp``, ``time``, ``cp``, ``ep``). Its ranks hold the parameters
``replicated`` (gradients averaged over them), ``sharded`` (FSDP2) or ``split`` (each its own part).

The mesh, outermost first (torchtitan's order; ranks of the innermost dimension are neighbours): stage
dimensions, replicated ones, the sharded one, the other split ones; the config's order within each.

Applied in this order:

1. the in-place dimensions on the whole model, innermost first (``tp`` shards its layers, then ``time``
   splits the time steps of the neurons, sharded or not);
2. the blocks compiled where ``compile.enable`` asks;
3. a stage dimension (``pp``) splits the model and wraps each stage it keeps in step 4;
4. the gradient reduction: FSDP2 over the sharded dimension, replicated over the replicated ones (HSDP);
   where nothing shards parameters, DistributedDataParallel over the replicated ones, on a process group of
   its own (a pipeline averages its stages' gradients itself instead). :class:`Reduction` decides which.

A dimension never calls this module: it is handed what it needs (:meth:`Strategy.apply_dimension`).
"""

from __future__ import annotations

import itertools
import math

import attrs

from snnfw.config import with_settings
from snnfw.errors import PlanError, PluginError
from snnfw.plan.estimate import ddp_buckets, estimate, ring_bytes
from snnfw.plan.layout import AUTO, COMPOSED, Mesh, PlanRequest, Proposal
from snnfw.plugin.strategy import DATA, IN_PLACE, REPLICATED, SHARDED, SPLIT, STAGES, Strategy

EXAMPLE = "parallel.mesh = {dp_shard = 2, tp = 2}"


def owners(plugins) -> dict[str, str]:
    """Each mesh dimension a registered strategy owns, and that strategy's name."""
    found: dict[str, str] = {}
    for entry in plugins.strategies.entries():
        dimension = getattr(entry.value, "dimension", None)
        if dimension in found:
            raise PluginError(f"mesh dimension {dimension!r} is owned by two strategies, {found[dimension]!r} and "
                              f"{entry.name!r}; uninstall or block the plugin of one")
        if dimension:
            found[dimension] = entry.name
    return found


def refuse_others(request: PlanRequest, owners: tuple[str, ...], reason: str,
                  dimensions: tuple[str, ...] | None = None) -> list[Proposal]:
    """Refusals of the strategies asked for (under ``auto``, every registered one) but ``owners``, and of the
    composed meshes without one of ``dimensions``, those that apply the key there (default: the owners'
    dimensions; :func:`refuse_meshes`).

    How a plugin refuses a key only ``owners`` apply: under ``auto`` these rule out
    the other candidates alone.
    """
    asked = [name for name in request.plugins.strategies.names() if _proposes(request.plugins.strategy(name))] \
        if request.strategy == AUTO else [request.strategy]
    if dimensions is None:
        registered = request.plugins.strategies.names()
        dimensions = tuple(request.plugins.strategy(name).dimension for name in owners if name in registered)
    refusals = [Proposal.refuse(name, reason) for name in asked if name not in owners and name != COMPOSED]
    if COMPOSED not in owners:
        refusals += refuse_meshes(request, lambda dims: None if set(dimensions) & set(dims) else reason)
    return refusals


def _proposes(strategy: Strategy) -> bool:
    """Whether ``strategy`` proposes itself under ``auto``: a dimension's strategy proposes only through the
    composition."""
    return type(strategy).propose is not Strategy.propose


def refuse_meshes(request: PlanRequest, why) -> list[Proposal]:
    """Refusals of the composed meshes asked for for which ``why(dims)`` (``dims``: each dimension of more than one
    rank and its :class:`~snnfw.plugin.strategy.Strategy`) gives a reason: the configured mesh, or under ``auto``
    each candidate mesh, each refusal then carrying its mesh so that it rules out that mesh alone."""
    if not request.asks_for(COMPOSED):
        return []
    owned = owners(request.plugins)
    meshes = [request.config.parallel.mesh] if request.config.parallel.mesh else \
        candidate_meshes(request.topology.world_size, list(owned)) if request.strategy == AUTO else []
    refused = []
    for mesh in meshes:
        dims = {name: request.plugins.strategy(owned[name]) for name, size in mesh if size > 1 and name in owned}
        if reason := why(dims):
            refused.append(Proposal.refuse(COMPOSED, reason) if request.strategy == COMPOSED else
                           attrs.evolve(Proposal.refuse(COMPOSED, reason), mesh=tuple(mesh)))
    return refused


def _nesting(strategy: Strategy) -> int:
    """Where a dimension sits in the mesh, outermost first."""
    if strategy.splits_stages:
        return 0
    return {REPLICATED: 1, SHARDED: 2}.get(strategy.parameters, 3)


def propose_mesh(request: PlanRequest, asked: Mesh | None = None) -> Proposal:
    """The composed proposal of ``asked`` (default ``parallel.mesh``): every dimension's strategy asked for its
    part, or the refusal naming the dimension (or the two) that cannot run. Under ``auto``, one proposal for each
    combination of the settings the dimensions offer (:meth:`Strategy.variants`), each with its ``settings``."""
    plugins, asked = request.plugins, asked or request.config.parallel.mesh
    if not asked:
        return Proposal.refuse(COMPOSED, f"it composes the dimensions parallel.mesh names; set {EXAMPLE}")
    owned = owners(plugins)
    for name, _ in asked:
        if name not in owned:
            hint = (" (dp_replicate for DistributedDataParallel, dp_shard for FSDP2)" if name == "dp" else "")
            return Proposal.refuse(COMPOSED, f"parallel.mesh names dimension {name!r}, which no strategy owns{hint}; "
                                             f"dimensions: {', '.join(sorted(owned))}")
    kept = [(name, size) for name, size in asked if size > 1]
    if not kept:
        return Proposal.refuse(COMPOSED, "every dimension of parallel.mesh has size 1; use strategy none on one rank")
    strategies = {name: plugins.strategy(owned[name]) for name, _ in kept}
    mesh = tuple(sorted(kept, key=lambda dim: _nesting(strategies[dim[0]])))
    strategies = {name: strategies[name] for name, _ in mesh}  # in mesh order
    names = [name for name, _ in mesh]
    sharding = [n for n in names if strategies[n].parameters == SHARDED]
    staging = [n for n in names if strategies[n].splits_stages]
    for both, what in ((sharding, "shard the parameters"), (staging, "split the model into stages")):
        if len(both) > 1:
            return Proposal.refuse(COMPOSED, f"dimensions {both[0]} and {both[1]} both {what}; keep one of them")
    layout = Proposal(
        COMPOSED,
        mesh=mesh,
        dp_dims=tuple(n for n in names if strategies[n].splits_batch),
        stage_dims=tuple(n for n in names if strategies[n].splits_stages),
        replicated_neuron_dims=tuple(n for n in names if strategies[n].neurons_alike),
        strategies=tuple(owned[n] for n in names),
    )
    dropped = [f"{n} = 1" for n, s in asked if s == 1]
    if request.strategy != AUTO:
        return _composed(request, layout, strategies, dropped)
    variants = [strategies[name].variants(request, layout) or [()] for name in names]
    proposals = [_composed(request, layout, strategies, dropped, sum(combo, ())) for combo in itertools.product(*variants)]
    return proposals[0] if len(proposals) == 1 else proposals


def _composed(request: PlanRequest, layout: Proposal, strategies: dict[str, Strategy], dropped: list[str],
              settings: tuple = ()) -> Proposal:
    """``layout`` with each dimension's part (:meth:`Strategy.propose_dimension`) under the config with
    ``settings`` applied, its rationale and estimate; or the refusal naming the dimension that cannot run."""
    if settings:
        config, _ = with_settings(request.config, dict(settings))
        request = attrs.evolve(request, config=config)
    mesh, names = layout.mesh, [name for name, _ in layout.mesh]
    parts = []
    for name, owner in zip(names, layout.strategies):
        part = strategies[name].propose_dimension(request, layout) or Proposal(owner, rationale=(
            f"{name} = {dict(mesh)[name]}",))
        if part.refusal:
            return attrs.evolve(Proposal.refuse(COMPOSED, f"dimension {name} ({owner}): {part.refusal}"),
                                settings=settings)
        parts.append(part)
    shape = " x ".join(f"{n}={s}" for n, s in mesh)
    rationale = (f"composed mesh {shape} (outermost first)" + (f"; {', '.join(dropped)} left out" if dropped else ""),
                 *(line for part in parts for line in part.rationale), Reduction.of(strategies).line())
    microbatches = max((p.microbatches for p in parts if p.microbatches), default=None)
    layout = attrs.evolve(layout, rationale=rationale, microbatches=microbatches, settings=settings)
    cost = _estimate(request, layout, strategies, parts)
    return attrs.evolve(layout, estimate=cost)


def _estimate(request: PlanRequest, layout: Proposal, strategies: dict[str, Strategy], parts: list[Proposal]):
    """The coarse cost :mod:`snnfw.plan.estimate` ranks candidates by: a rank's share of the parameters (split and
    sharded dimensions), of the samples (data dimensions), of the activations and the compute (the dimensions that
    are not data ones); the gradient reduction's bytes, tensor-parallel activations' and a pipeline's bubble; the
    collective calls of each. What a dimension's ranks compute beyond their share (a time split's ranks wait on
    each other) its proposal adds (``Proposal.added_compute_ms``), and so the bytes, calls and optimizer shards it
    adds (``added_comm_bytes``, ``added_calls``, ``optimizer_shards``: a sharded optimizer over replicas;
    ``activation_shards``, ``bubble``: a pipeline schedule's)."""
    cost, added = request.cost, parts
    if cost is None:
        return None
    sizes, names = dict(layout.mesh), [name for name, _ in layout.mesh]
    reduction = Reduction.of(strategies)
    averaged, sharded = reduction.averaged, reduction.sharded
    split = math.prod(sizes[n] for n in names if strategies[n].parameters == SPLIT)
    shards = sizes[sharded] if sharded else 1
    # the dimensions that split each sample's work (a data dimension applied in place, ep, splits the samples instead)
    parts = math.prod(sizes[n] for n in names if strategies[n].order != DATA and not strategies[n].splits_batch)
    samples = request.config.data.batch_size / layout.replicas
    params = cost.parameter_bytes / split
    comm = (1.5 * ring_bytes(params, shards) if sharded else 0.0) + ring_bytes(params / shards,
                                                                                math.prod(sizes[n] for n in averaged))
    comm += sum(ring_bytes(cost.activation_bytes * samples, sizes[n]) for n in names
                if strategies[n].parameters == SPLIT and not strategies[n].splits_stages)
    stages = math.prod(sizes[n] for n in layout.stage_dims)
    micro = request.config.train.microbatches or layout.microbatches or 1
    calls = (3 * (len(request.analysis.blocks) + 1) if sharded else ddp_buckets(params / shards) if averaged else 0)
    calls += sum(2 * len(request.analysis.neurons) for n in names
                 if strategies[n].parameters == SPLIT and not strategies[n].splits_stages)
    calls += 4 * micro if stages > 1 else 0
    optimizer_shards = split * shards * math.prod(part.optimizer_shards for part in added)
    comm += sum(part.added_comm_bytes for part in added)
    calls += sum(part.added_calls for part in added)
    bubble = next((part.bubble for part in added if part.bubble is not None), (stages - 1) / (micro + stages - 1))
    cost = estimate(request, samples=samples, parameter_shards=split * shards, optimizer_shards=optimizer_shards,
                    activation_shards=parts * math.prod(part.activation_shards for part in added),
                    compute_shards=parts, comm_bytes=comm, bubble=bubble, calls=calls)
    return attrs.evolve(cost, compute_ms=cost.compute_ms + sum(part.added_compute_ms for part in added))


def candidate_meshes(world: int, dimensions: list[str]) -> list[Mesh]:
    """Every mesh of one, two or three of ``dimensions`` whose sizes (2 or more) multiply to ``world``: ``auto``'s
    candidates."""
    return [tuple(zip(dims, sizes)) for count in (1, 2, 3) for dims in itertools.combinations(sorted(dimensions), count)
            for sizes in _factors(world, count)]


def _factors(world: int, count: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``world`` into ``count`` factors of 2 or more."""
    if count == 1:
        return [(world,)] if world >= 2 else []
    return [(first, *rest) for first in _divisors(world) if first >= 2 for rest in _factors(world // first, count - 1)]


def _divisors(number: int) -> list[int]:
    """The divisors of ``number`` in increasing order, made from its prime factors (found by trial division up to
    the square root of what is left), not by trying every number up to it."""
    divisors, prime = [1], 2
    while number > 1:
        if prime * prime > number:  # what is left is prime
            prime = number
        multiples = divisors
        while number % prime == 0:
            number //= prime
            multiples = [d * prime for d in multiples]
            divisors = divisors + multiples
        prime += 1 if prime == 2 else 2
    return sorted(divisors)


@attrs.frozen
class Reduction:
    """How a composed mesh reduces its gradients: the one place that decides between FSDP2 (HSDP),
    DistributedDataParallel and a pipeline's own averaging. The plan's rationale, the estimate, the apply step
    and whether the ranks can build only their shards (:class:`snnfw.plan.composed.Composed`) all read it."""

    averaged: tuple[str, ...]  # the dimensions whose ranks average their gradients (REPLICATED), in mesh order
    sharded: str | None  # the dimension FSDP2 shards over (SHARDED), at most one
    staged: bool  # a dimension splits the model into stages

    @classmethod
    def of(cls, strategies: dict[str, Strategy]) -> "Reduction":
        """The reduction of a mesh whose dimensions (of more than one rank) have ``strategies``, in mesh order."""
        sharded = [name for name, strategy in strategies.items() if strategy.parameters == SHARDED]
        return cls(averaged=tuple(name for name, strategy in strategies.items() if strategy.parameters == REPLICATED),
                   sharded=sharded[0] if sharded else None,
                   staged=any(strategy.splits_stages for strategy in strategies.values()))

    @classmethod
    def of_plan(cls, plan, hooks) -> "Reduction":
        """The reduction of ``plan``'s composed mesh."""
        names = [name for name, _ in plan.mesh]
        return cls.of(dict(zip(names, map(hooks.strategy, plan.strategies))))

    @property
    def ddp(self) -> bool:
        """DistributedDataParallel over the averaged dimensions: nothing shards, and no pipeline averages its
        stages' gradients itself."""
        return bool(self.averaged) and self.sharded is None and not self.staged

    @property
    def stage_averaged(self) -> tuple[str, ...]:
        """The dimensions a stage dimension averages its stages' gradients over itself: the averaged ones, unless
        FSDP2 reduces over them (HSDP)."""
        return self.averaged if self.staged and self.sharded is None else ()

    def line(self) -> str:
        """The plan's line on it."""
        if self.sharded:
            over = f", replicated over {' x '.join(self.averaged)} (HSDP)" if self.averaged else ""
            return f"gradients: FSDP2 reduce-scatter over {self.sharded}{over}"
        if not self.averaged:
            return "gradients: no data dimension, each rank's parameters are its own"
        if self.staged:
            return f"gradients: each stage's averaged over {' x '.join(self.averaged)} after the step's last microbatch"
        return f"gradients: DistributedDataParallel over {' x '.join(self.averaged)}"

    def shard_mesh(self, mesh):
        """The device mesh ``fully_shard`` takes over the sharded dimension: 1-D, or 2-D (replicated, sharded;
        HSDP) with the averaged dimensions flattened into one, ``replicate``."""
        if not self.averaged:
            return mesh[self.sharded]
        if len(self.averaged) > 1:
            import warnings

            mesh[self.averaged]._flatten("replicate")
            with warnings.catch_warnings():  # torch 2.13 warns that slicing a flattened dimension will change (2.11's note)
                warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh", UserWarning)
                return mesh["replicate", self.sharded]
        return mesh[self.averaged[0], self.sharded]

    def stage_group(self, mesh):
        """The process group a stage dimension averages its stages' gradients over (:attr:`stage_averaged`), or
        None."""
        from snnfw.distributed.groups import rows_group

        return rows_group(mesh, self.stage_averaged) if self.stage_averaged else None


def apply_mesh(model, plan, mesh, hooks):
    """``plan``'s composed mesh applied to ``model`` in the module's order; returns the model to train. Each
    dimension gets what :meth:`Strategy.apply_dimension` says its role gets."""
    from snnfw.distributed.groups import replicate, rows_group

    names = [name for name, _ in plan.mesh]
    strategies = dict(zip(names, map(hooks.strategy, plan.strategies)))
    for name in reversed(names):  # innermost first
        if strategies[name].order == IN_PLACE:
            model = strategies[name].apply_dimension(model, plan, mesh, hooks)
    reduction = Reduction.of(strategies)
    shard_mesh = reduction.shard_mesh(mesh) if reduction.sharded else None

    def wrap(module, module_plan=plan):  # module_plan: plan as it applies to module (a stage: its blocks within it)
        if reduction.sharded:
            return strategies[reduction.sharded].apply_dimension(module, module_plan, shard_mesh, hooks)
        if reduction.ddp:  # which reads the parameters as it wraps them: a meta build is materialized first
            _check_ddp_parameters(module, reduction)
            if getattr(hooks, "run", None) is not None and hooks.run.materialize is not None:
                hooks.run.materialize(module)
            return replicate(module, plan.device_type, rows_group(mesh, reduction.averaged))
        return module

    staged = [strategies[n] for n in names if strategies[n].order == STAGES]
    if staged:
        return staged[0].apply_dimension(model, plan, mesh, hooks, wrap, group=reduction.stage_group(mesh))
    hooks.compile(model, plan)
    return wrap(model)


def _check_ddp_parameters(module, reduction: Reduction) -> None:
    """Refuses (alike on every rank, before any collective) DistributedDataParallel over DTensor parameters it is
    not told to leave alone (tp's ``linear_mlp`` style makes them), whose gradients its buckets cannot take."""
    from torch.distributed.tensor import DTensor

    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # ep's experts: averaged by ep itself
    dtensors = [name for name, p in module.named_parameters() if isinstance(p, DTensor) and name not in ignored]
    if dtensors:
        raise PlanError(f"DistributedDataParallel over {' x '.join(reduction.averaged)} cannot average DTensor "
                        f"parameters, and the model has {len(dtensors)} of them ({dtensors[0]}, ...; tp's linear_mlp "
                        "style makes them); shard the data dimension instead (dp_shard for dp_replicate), or give "
                        "those modules another tp style in model.tp_plan")


# Published in snnfw.api by 0.2.0, deprecated there in 0.3.0 and removed in 0.4.0 (snnfw.api.DEPRECATED says what
# replaces each): what a dimension's strategy now receives from the core instead.

def fsdp_mesh(plan, mesh, hooks, dimension: str):
    """The device mesh ``fully_shard`` takes for the sharded ``dimension`` (:meth:`Reduction.shard_mesh`)."""
    return attrs.evolve(Reduction.of_plan(plan, hooks), sharded=dimension).shard_mesh(mesh)


def stage_averaged_dims(plan, hooks) -> tuple[str, ...]:
    """The dimensions a stage dimension averages its stages' gradients over itself (:attr:`Reduction.stage_averaged`)."""
    return Reduction.of_plan(plan, hooks).stage_averaged


def replicas(layout) -> int:
    """How many data replicas ``layout`` (a proposal) makes (:attr:`snnfw.plan.layout.Proposal.replicas`)."""
    return layout.replicas
