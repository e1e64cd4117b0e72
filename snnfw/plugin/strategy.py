"""What the core asks of a parallelism strategy besides its hooks: a strategy plugin registers one of these.

A strategy may own one dimension of a composed mesh (``parallel.mesh`` alone,
strategy ``mesh``): it names the dimension (:attr:`Strategy.dimension`), says
how its ranks hold the parameters and the batch (the attributes below), checks
a size of it (:meth:`Strategy.propose_dimension`) and applies it
(:meth:`Strategy.apply_dimension`). The core composes the dimensions in one
order (:mod:`snnfw.plan.compose`), so a dimension never names another, and
hands each what it needs of the others: the layout so far (its ``replicas``)
to propose, the mesh or process group of the gradient reduction to apply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from snnfw.config import Config

REPLICATED, SHARDED, SPLIT = "replicated", "sharded", "split"  # how a dimension's ranks hold the parameters
IN_PLACE, STAGES, DATA = 100, 200, 300  # when a dimension applies: on the model in place, splitting it, reducing gradients
ROOT_HOOKS = "snnfw_root_hooks"


def hook_root(model: torch.nn.Module, before: Callable, after: Callable) -> None:
    """Registers ``before`` (a forward pre-hook, run first) and ``after`` (a forward hook) on ``model``, as an
    in-place dimension changes the model's input and output; notes them in its ``snnfw_root_hooks`` so that a
    stage dimension, which never calls the model's own forward, runs them before its first unit and after its last."""
    model.register_forward_pre_hook(before, prepend=True)
    model.register_forward_hook(after)
    vars(model).setdefault(ROOT_HOOKS, []).append((before, after))


class Strategy:
    """A strategy's answers to the core; the defaults fit a plain torch optimizer and a model that a dry run on a
    fake process group can step as it is. A plugin subclasses it where its strategy differs and registers an
    instance: ``register("mine", MyStrategy(), "what it does")``."""

    dimension: str | None = None  # the parallel.mesh dimension this strategy owns in a composed mesh
    parameters: str = REPLICATED  # its ranks hold the same parameters (gradients averaged), shards of them, or parts
    splits_batch: bool = False  # its ranks see different samples
    splits_stages: bool = False  # its ranks hold different pipeline stages
    neurons_alike: bool = False  # a neuron it does not shard runs alike on its ranks (its spikes count once)
    order: int = IN_PLACE  # IN_PLACE changes the model, STAGES splits it, DATA reduces gradients (snnfw.plan.compose)
    shards_parameters = False
    """True where every rank holds only its shard of the parameters (its state dict's pieces): ranks then build
    the model on the meta device and materialize only their pieces (:mod:`snnfw.distributed.materialize`)."""

    def propose(self, request):
        """How this strategy would run ``request`` (:class:`snnfw.plan.layout.PlanRequest`), asked when the config
        names it or ``auto``: a :class:`snnfw.plan.layout.Proposal` (a refusal with its reason if it cannot run),
        a list of variants with their ``settings`` for ``auto`` to rank, or None to leave it to the plugin's
        ``snnfw_plan``."""
        return None

    def label(self, config: dict, plan: dict) -> str | None:
        """Words reports add to a benchmark record's strategy for this strategy (a pipeline's schedule), given the
        record's ``config`` and ``plan`` as written (dicts); None adds none."""
        return None

    def builds_shards(self, config, plugins) -> bool:
        """Whether this strategy's ranks build only their shards for ``config``: :attr:`shards_parameters`."""
        return self.shards_parameters

    def builds_whole(self, config, plugins) -> str | None:
        """Why this strategy's ranks build the whole model for ``config`` though it shards parameters (the plan says
        so in one line), or None."""
        return None

    def reads_values(self, config, plugins) -> bool:
        """Whether applying this strategy to ``config``'s model runs it (a pipeline measures its split). Where its
        ranks build only their shards, the model it is given is then on the meta device and it reads each tensor's
        initial value through ``hooks.initial``, which only a recorded build gives: a build the recording refuses
        is built whole on every rank instead of sent by rank 0 to the ranks that hold it."""
        return False

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer-state tensors this rank holds (the dry run counts them): a sharding wrapper's
        (ZeroRedundancyOptimizer) those of the local optimizer it keeps (``optim``)."""
        optimizer = getattr(optimizer, "optim", optimizer)
        return [value for state in optimizer.state.values() for value in state.values() if _is_tensor(value)]

    def for_fake_world(self, model: torch.nn.Module, config: Config) -> Config:
        """Readies the applied ``model`` for a dry-run step on a fake process group, which answers no collective;
        returns ``config`` with what this rank decided that the next rank must reuse (a fake group cannot
        broadcast it)."""
        return config

    def propose_dimension(self, request, layout):
        """This strategy's part of a composed mesh: a :class:`snnfw.plan.layout.Proposal` of its dimension (its
        rationale, a refusal, the microbatches it needs, the compute its ranks add beyond their share:
        ``added_compute_ms``), or None to accept it as it is. ``layout`` is the
        composed proposal so far: the whole mesh, in the core's order, and which dimensions split the batch
        (``layout.replicas``: how many data replicas they make)."""
        return None

    def variants(self, request, layout) -> list[tuple[tuple[str, object], ...]]:
        """Under ``auto``, the settings of this dimension to weigh on ``layout`` (each a tuple of ``("section.key",
        value)`` pairs for keys the user did not set: a pipeline's schedules), or [] to take the config as it is."""
        return []

    def apply_dimension(self, model: torch.nn.Module, plan, mesh, hooks, wrap: Callable | None = None, group=None):
        """Applies this dimension to ``model`` and returns the model. The core calls it in its order
        (:mod:`snnfw.plan.compose`) and decides the gradient reduction (FSDP2, HSDP, DistributedDataParallel or a
        pipeline's own averaging: ``compose.Reduction``), handing each role what that needs:

        - ``IN_PLACE``: ``mesh`` is the whole device mesh;
        - ``SHARDED``: ``mesh`` is the device mesh its shards span, as ``fully_shard`` takes it: 1-D over this
          dimension, or 2-D (the averaged dimensions flattened into one, then this one: HSDP); it is called on the
          model, or on each stage a stage dimension keeps, with ``plan`` as it applies there;
        - ``STAGES``: ``mesh`` is the whole device mesh; it calls ``wrap(stage, stage_plan)`` on each stage it keeps
          (the data dimensions' part), ``stage_plan`` being ``plan`` as it applies to the stage (its blocks named
          within it), and averages its stages' gradients over ``group`` after a step's last microbatch (None where
          FSDP2 reduces them, or no dimension averages).

        The default does nothing: the core averages the gradients over ``REPLICATED`` dimensions itself."""
        return model


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
