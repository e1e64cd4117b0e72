"""plan: choose and validate the parallel layout before any process group exists."""

from __future__ import annotations

import math
from typing import Any

import attrs

from snnfw.config import COMPOSED, Config, with_settings
from snnfw.distributed.layout import Layout
from snnfw.errors import PlanError
from snnfw.model.analysis import Analysis

Mesh = tuple[tuple[str, int], ...]
AUTO = "auto"
GLOO_CUDA_POINT_TO_POINT = ("gloo sends and receives point to point from host memory only, not CUDA tensors; give each "
                            "rank a GPU of its own (parallel.backend = \"auto\": NCCL), or set parallel.device = \"cpu\"")


@attrs.frozen
class Topology:
    """The world a plan is made for."""

    world_size: int
    device_type: str = "cpu"
    rationale: tuple[str, ...] = ()  # why auto chose the CPU on a host with GPUs
    device_memory: float | None = None  # bytes a rank may use where the caller knows (a dry run's --device-memory)
    backend_choice: str = "auto"  # parallel.backend

    def memory_per_rank(self) -> float:
        """``device_memory``, else this machine's: its GPU's, or an even share of its memory among the ranks."""
        from snnfw.plan.estimate import device_memory_bytes

        return self.device_memory if self.device_memory is not None else device_memory_bytes(self.device_type, self.world_size)

    @property
    def backend(self) -> str:
        from snnfw.distributed.collectives import collective_backend

        return collective_backend(self.device_type, self.backend_choice)

    @property
    def shares_gpus(self) -> bool:
        """Ranks on CUDA under gloo, which may share a GPU: point-to-point sends of CUDA tensors cannot run."""
        return self.device_type == "cuda" and self.backend == "gloo"

    @classmethod
    def detect(cls, world_size: int, device: str = "auto", local_ranks: int | None = None,
               backend: str = "auto") -> "Topology":
        """The world on ``parallel.device``; ``auto`` is CUDA where this node has a GPU for each of its ranks.
        ``backend`` (``parallel.backend``) ``gloo`` lets ``cuda`` ranks outnumber (and share) the GPUs.

        ``local_ranks``, the ranks on this node, defaults to ``LOCAL_WORLD_SIZE`` (set in a launched rank),
        else ``world_size``.
        """
        import os

        import torch

        if backend != "auto" and world_size == 1:
            raise PlanError(f"parallel.backend = {backend!r} chooses the collectives of 2 or more ranks, and this run "
                            "has one; remove it")
        local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        shared = device == "cuda" and backend == "gloo" and gpus
        if device == "cuda" and gpus < local and not shared:
            fewer = f"launch at most {gpus} rank(s) per node, set parallel.backend = \"gloo\" to share them, or " if gpus else ""
            raise PlanError(
                f'parallel.device = "cuda" needs a GPU per rank: {local} rank(s) on this node asked for one and '
                f'{gpus} GPU(s) were found; {fewer}set parallel.device = "cpu" or "auto"'
            )
        if device == "cuda" or (device == "auto" and gpus >= local):
            return cls(world_size=world_size, device_type="cuda", backend_choice=backend)
        if backend == "nccl":
            raise PlanError('parallel.backend = "nccl" runs on CUDA and this run is on the CPU; remove it, or set '
                            'parallel.device = "cuda" on a host with a GPU per rank')
        fallback = (
            f'device cpu: {local} rank(s) on this node and {gpus} GPU(s); parallel.device = "auto" takes CUDA '
            f'only with a GPU per rank',
        )
        return cls(world_size=world_size, device_type="cpu", rationale=fallback if device == "auto" and gpus else ())


@attrs.frozen
class PlanRequest:
    """What a strategy plugin sees when asked to propose a plan."""

    config: Config
    topology: Topology
    analysis: Analysis
    model: Any = None  # the built, unparallelized model, for shape checks
    cost: Any = None  # snnfw.plan.estimate.ModelCost, measured when the strategy is "auto"
    plugins: Any = None  # a snnfw.plugin.context.HookContext: the registries (strategies, schedules, ...)

    @property
    def strategy(self) -> str:
        return self.config.parallel.strategy

    def asks_for(self, strategy: str) -> bool:
        """True when a plugin owning ``strategy`` should answer: asked by name, or by ``auto``."""
        return self.strategy in (strategy, AUTO)


@attrs.frozen
class Proposal:
    """A strategy's answer: a mesh and its data-parallel dimensions, or a refusal.

    ``microbatches`` is the strategy's choice for when ``train.microbatches`` is
    absent (otherwise 1). ``settings`` are config values (``"section.key"``,
    value) the proposal was made for, which ``auto`` applies if it picks it.
    A plugin may answer with a list of proposals (``auto`` ranks them all).
    What the core must know of the mesh, the strategy declares:
    ``dp_dims`` split the batch into replicas; ``stage_dims`` split the model
    into stages (a rank holds only its stages' parameters); over
    ``replicated_neuron_dims`` a neuron the strategy does not shard runs alike
    on every rank (its spikes count once in the firing rate).
    """

    strategy: str
    mesh: Mesh = ()
    dp_dims: tuple[str, ...] = ()
    stage_dims: tuple[str, ...] = ()
    replicated_neuron_dims: tuple[str, ...] = ()
    rationale: tuple[str, ...] = ()
    refusal: str | None = None
    microbatches: int | None = None
    estimate: Any = None  # snnfw.plan.estimate.Estimate, required to take part in auto
    settings: tuple[tuple[str, Any], ...] = ()
    strategies: tuple[str, ...] = ()  # a composed mesh's: the strategy owning each dimension, in mesh order
    added_compute_ms: float = 0.0  # a dimension's (propose_dimension): what its ranks compute beyond their share,
    added_comm_bytes: float = 0.0  # ... the bytes they send beyond the composition's gradient reduction,
    added_calls: int = 0  # ... the collective calls they add,
    optimizer_shards: int = 1  # ... how many ways they shard the optimizer state beyond the parameters' shards,
    activation_shards: float = 1.0  # ... the activations beyond their size (a pipeline's microbatches in flight),
    bubble: float | None = None  # ... and the idle share of a step (a stage dimension's schedule)

    @classmethod
    def refuse(cls, strategy: str, reason: str) -> "Proposal":
        return cls(strategy=strategy, refusal=reason)

    @property
    def replicas(self) -> int:
        """How many data replicas it makes: its batch-splitting dimensions' ranks (``dp_dims``) together."""
        sizes = dict(self.mesh)
        return math.prod(sizes[d] for d in self.dp_dims)


@attrs.frozen
class Plan:
    """The resolved layout every rank runs: recorded in metrics and shown by ``snnfw plan``."""

    strategy: str
    world_size: int
    mesh: Mesh
    dp_dims: tuple[str, ...]
    stage_dims: tuple[str, ...]
    replicated_neuron_dims: tuple[str, ...]
    microbatches: int
    global_batch: int
    device_type: str
    backend: str
    rationale: tuple[str, ...]
    config: Config
    analysis: Analysis
    strategies: tuple[str, ...] = ()  # a composed mesh's: the strategy owning each dimension, in mesh order
    preset: str | None = None  # the name the config asked for where it is a preset of a mesh (snnfw.plan.presets)

    @property
    def name(self) -> str:
        """What the plan is called: its preset, else its strategy."""
        return self.preset or self.strategy

    @property
    def dp_size(self) -> int:
        return self.size(self.dp_dims)

    def size(self, dims: tuple[str, ...]) -> int:
        """How many ranks the mesh dimensions ``dims`` span together."""
        sizes = dict(self.mesh)
        return math.prod(sizes[d] for d in dims)

    @property
    def layout(self) -> Layout:
        """The mesh and its dimensions' roles, as the distributed primitives take them."""
        return Layout(self.mesh, self.dp_dims, self.stage_dims, self.replicated_neuron_dims, self.device_type, self.backend)

    @property
    def replica_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def microbatch_size(self) -> int:
        return self.replica_batch // self.microbatches

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, filter=lambda a, _: a.name not in ("config", "analysis"))
        out["mesh"] = dict(self.mesh)
        out.update(dp_size=self.dp_size, replica_batch=self.replica_batch, microbatch_size=self.microbatch_size)
        return out


def make_plan(config: Config, topology: Topology, analysis: Analysis, plugins, model=None,
              chosen: tuple[str, ...] = (), asked: str | None = None) -> Plan:
    """Asks the strategy's plugin for a proposal and checks it against the world and batch.

    ``config`` names one strategy or preset (``auto`` is resolved before, :mod:`snnfw.plan.auto`); a preset is
    planned as its mesh (:mod:`snnfw.plan.presets`), and a mesh that is a preset's layout is named by it
    (``Plan.preset``), however the config spelled it; ``chosen`` is how it was chosen, the plan's first rationale;
    ``asked``, the name a refusal gives where the config's preset was resolved before (default: the config's).
    """
    from snnfw.plan.presets import check_name, name_of, resolve

    check_name(config.parallel.strategy, plugins)
    asked = asked or config.parallel.strategy
    config = resolve(config, topology.world_size)
    if config.parallel.prefer:
        config, changed = with_settings(config, plugins.preference_defaults(config))
        chosen += tuple(f"prefer {config.parallel.prefer}: {change}" for change in changed)
    request = PlanRequest(config=config, topology=topology, analysis=analysis, model=model, plugins=plugins.context)
    answers = [p for p in plugins.propose(request) if p.strategy == request.strategy]
    refusals = [p.refusal for p in answers if p.refusal]
    if refusals:
        raise PlanError(f"strategy {asked!r} cannot run: {'; '.join(refusals)}")
    if len(answers) != 1:
        raise PlanError(
            f"strategy {request.strategy!r} got {len(answers)} proposals from plugins; exactly one plugin must own it"
        )
    proposal = answers[0]
    preset = name_of(proposal.mesh, config) if proposal.strategy == COMPOSED else None
    product = math.prod(n for _, n in proposal.mesh)
    shape = " x ".join(f"{d}={n}" for d, n in proposal.mesh)
    if product != topology.world_size:
        raise PlanError(
            f"mesh {shape} has {product} ranks but the world has {topology.world_size}; "
            f"change parallel.mesh or launch with --nproc {product}"
        )
    dp = proposal.replicas
    batch = config.data.batch_size
    micro = config.train.microbatches or proposal.microbatches or 1
    if batch % (dp * micro):
        raise PlanError(
            f"data.batch_size {batch} must be divisible by data-parallel size {dp} x "
            f"train.microbatches {micro} = {dp * micro}; change one of them"
        )
    spelled = (f"strategy {preset} is the mesh {{{', '.join(f'{d} = {n}' for d, n in proposal.mesh)}}}",) if preset else ()
    rationale = chosen + spelled + proposal.rationale + (
        f"global batch {batch} = {dp} replica(s) x {micro} microbatch(es) x {batch // (dp * micro)} samples",
    )
    return Plan(
        strategy=proposal.strategy,
        world_size=topology.world_size,
        mesh=proposal.mesh,
        dp_dims=proposal.dp_dims,
        stage_dims=proposal.stage_dims,
        replicated_neuron_dims=proposal.replicated_neuron_dims,
        microbatches=micro,
        global_batch=batch,
        device_type=topology.device_type,
        backend=topology.backend,
        rationale=rationale,
        config=config,
        analysis=analysis,
        strategies=proposal.strategies,
        preset=preset,
    )
