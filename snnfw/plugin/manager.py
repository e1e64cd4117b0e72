"""Plugin loading and the typed facade through which the core calls hooks.

The core's own plugins (:data:`CORE_PLUGINS`: the composition, strategy
``mesh``) are registered first, always. Plugins are found through the ``snnfw``
entry-point group. snnfw's own are
always loaded; third-party ones too unless ``SNNFW_DISABLE_PLUGIN_AUTOLOAD=1``.
``SNNFW_BLOCK_PLUGINS=name,other`` keeps the named entry points from loading;
``SNNFW_PLUGINS=module,other`` loads modules as plugins without an entry point.
Plugin names are entry-point names: two entry points of one name fail to
load, naming both. A registered strategy object whose methods are hook
implementations is a plugin of its own (``strategy:NAME``), called only for a
plan of its strategy: for hooks that take ``plan``, the other strategies'
objects are left out. A plugin whose every registered name another plugin
overrides (``register(..., overrides=True)``) is unloaded. An exception that
escapes a hook carries a note naming the plugin and distribution it came from;
one that a plugin other than snnfw's own raised ends a command on one line
naming the plugin and the hook (:func:`plugin_hook`).
A third-party plugin that fails to import is left out (``Plugins.failed``):
listed by ``snnfw plugins``, and named where a config asks for a name that is
not registered.
"""

from __future__ import annotations

import ast
import copy
import importlib
import os
import re
from importlib import metadata
from typing import Any

import attrs
import pluggy

from snnfw import entry_points
from snnfw.entry_points import GROUP
from snnfw.errors import PluginError, keys_phrase, said
from snnfw.plugin import hookspecs
from snnfw.plugin.context import Context
from snnfw.plugin.registry import Registry
from snnfw.plugin.strategy import Strategy

ENV_PLUGINS = "SNNFW_PLUGINS"
CORE_PLUGINS = {"mesh": "snnfw.plan.composed"}
"""The core's own plugins, each named by its module as an entry point names a plugin: registered by the core
itself before any entry point (so every other plugin's hook implementations run before theirs), and never blocked."""
STRATEGY_PREFIX = "strategy:"  # the plugin name of a strategy object that implements hooks

_REGISTRATION_HOOKS = {
    "strategy": "snnfw_register_strategies",
    "model family": "snnfw_register_model_families",
    "dataset": "snnfw_register_datasets",
    "schedule": "snnfw_register_schedules",
    "optimizer": "snnfw_register_optimizers",
    "lr schedule": "snnfw_register_lr_schedules",
    "loss": "snnfw_register_losses",
}


@attrs.frozen
class PluginInfo:
    """What ``snnfw plugins`` shows, and what ranks compare at start-up."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]
    overridden_by: tuple[str, ...] = ()
    error: str = ""  # why it failed to import, if it did; then it is not loaded
    core: bool = False  # one of snnfw's core (CORE_PLUGINS), registered without an entry point


def _describe_entry_point(ep: metadata.EntryPoint) -> str:
    dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "no distribution"
    return f"{ep.value} ({dist})"


def _register(pm: pluggy.PluginManager, plugin: Any, name: str, described: str, remedy: str = "") -> None:
    """``pm.register``; a hook implementation that its hook cannot call (pluggy's PluginValidationError) is refused
    on one line naming the plugin (``described``: ``"plugin 'name' (...)"``), the hook and what is wrong, with
    ``remedy`` beside correcting it."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as err:
        text, other = str(err), f", or {remedy}" if remedy else ""
        hook, definition = re.search(r"hook '(\w+)'", text), re.search(r"hookimpl definition: (.*)", text)
        unknown = re.search(r"Argument\(s\) (\{.*\}) are declared", text)
        if hook is None:
            raise PluginError(f"{described} does not fit a hook it implements: {said(err)}; correct it{other}") from None
        if unknown:
            subject, _ = keys_phrase(sorted(ast.literal_eval(unknown[1])))
            spec = ", ".join(getattr(pm.hook, hook[1]).spec.argnames)
            what = f"{subject} not among its arguments ({spec}); take only those, by name{other}"
        else:  # as pluggy says it: a wrapper that is not a generator, ...
            what = f"{text.splitlines()[-1]}; correct it{other}"
        raise PluginError(f"{described} implements hook {hook[1]}" + (f" as {definition[1]}" if definition else "")
                          + f", which the hook cannot call: {what}") from None


def _named_plugins() -> list[tuple[str, Any]]:
    """The modules that ``SNNFW_PLUGINS`` names (comma-separated, as ``PYTEST_PLUGINS``), imported as plugins."""
    plugins = []
    for name in filter(None, (part.strip() for part in os.environ.get(ENV_PLUGINS, "").split(","))):
        try:
            plugins.append((name, importlib.import_module(name)))
        except SystemExit as err:
            raise PluginError(entry_points.exited(f"{ENV_PLUGINS} module {name!r}", err, f"take it out of {ENV_PLUGINS}")
                              ) from None
        except Exception as err:
            raise PluginError(f"{ENV_PLUGINS} names module {name!r}, which failed to import ({err!r}); "
                              f"fix it or take it out of {ENV_PLUGINS}") from err
    return plugins


def _load_core(pm: pluggy.PluginManager) -> dict[str, metadata.Distribution]:
    """Registers :data:`CORE_PLUGINS`; returns their distribution (snnfw's) by name."""
    if blocked := sorted(entry_points.blocked() & CORE_PLUGINS.keys()):
        raise PluginError(f"{entry_points.ENV_BLOCK} names {', '.join(map(repr, blocked))}, a plugin of snnfw's core that "
                          f"is always loaded; take it out of {entry_points.ENV_BLOCK}")
    for name, module in CORE_PLUGINS.items():
        _register(pm, importlib.import_module(module), name, f"plugin {name!r} (snnfw's core)")
    return dict.fromkeys(CORE_PLUGINS, metadata.distribution("snnfw"))


def _load_entry_points(pm: pluggy.PluginManager) -> tuple[dict[str, metadata.Distribution], dict[str, Any]]:
    """Registers every entry point under its name; two entry points with one name fail, naming both. Returns the
    loaded plugins' distributions and the third-party plugins that failed to import, by name."""
    blocked, autoload = entry_points.blocked(), entry_points.autoload()
    loaded: dict[str, metadata.EntryPoint] = {}
    failed: dict[str, tuple[metadata.EntryPoint, entry_points.ImportFailure]] = {}
    # Built-ins register first, so that third-party implementations run before them.
    for ep in sorted(entry_points.installed(GROUP), key=lambda ep: not entry_points.is_builtin(ep)):
        if ep.name in blocked:
            pm.set_blocked(ep.name)
            continue
        if not entry_points.is_builtin(ep) and not autoload:
            continue
        if ep.name in CORE_PLUGINS:
            raise PluginError(f"the entry point {_describe_entry_point(ep)} takes the name {ep.name!r} of a plugin of "
                              "snnfw's core; rename it in its [project.entry-points.snnfw] table (to replace strategy "
                              f"{ep.name!r}, register one under another plugin name with register(..., overrides=True))")
        if ep.name in loaded or ep.name in failed:
            first = loaded[ep.name] if ep.name in loaded else failed[ep.name][0]
            raise PluginError(
                f"two plugins have the entry-point name {ep.name!r}: {_describe_entry_point(first)} and "
                f"{_describe_entry_point(ep)}; plugin names are unique, so rename one entry point in its "
                "[project.entry-points.snnfw] table (to replace a plugin's strategies, families, data sets or "
                "schedules, register them under another plugin name with register(..., overrides=True))"
            )
        try:
            plugin = entry_points.load(ep)
        except PluginError:
            raise
        except Exception as err:  # a built-in's: a bug of snnfw's
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {err!r}") from err
        if isinstance(plugin, entry_points.ImportFailure):
            failed[ep.name] = ep, plugin
            continue
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "no distribution"
        _register(pm, plugin, ep.name, f"plugin {ep.name!r} ({dist})",
                  f"uninstall or block the plugin ({entry_points.ENV_BLOCK}={ep.name})")
        loaded[ep.name] = ep
    return {name: ep.dist for name, ep in loaded.items()}, {name: failure for name, (_, failure) in failed.items()}


def _strategies_of(plan, hook_name: str) -> tuple[str, ...]:
    """The strategies whose objects answer ``hook_name`` for ``plan``: its strategy and those of its composed
    mesh's dimensions, but only the strategy itself applies the plan."""
    strategy = getattr(plan, "strategy", None)
    if strategy is None:
        return ()
    return (strategy,) if hook_name == "snnfw_parallelize" else (strategy, *getattr(plan, "strategies", ()))


class _Hooks:
    """``pm.hook`` whose calls add to an escaping exception the plugin it was raised in, and leave out the
    strategy objects of other strategies than the ``plan``'s."""

    def __init__(self, plugins: "Plugins"):
        self._plugins = plugins

    def __getattr__(self, hook_name: str):
        plugins = self._plugins

        def call(**kwargs):
            plan = kwargs.get("plan")
            if plan is None:
                caller = getattr(plugins.pm.hook, hook_name)
            else:
                caller = plugins.scoped_caller(hook_name, _strategies_of(plan, hook_name))
            try:
                return caller(**kwargs)
            except Exception as err:
                self._plugins.blame(err, hook_name, caller.get_hookimpls())
                raise

        return call


class Plugins:
    """The loaded plugins, their registries, and one typed method per flow hook.

    A trainer calls the hooks through its own copy (:meth:`for_run`), on which ``run`` is its state.
    """

    run = None  # a trainer's snnfw.components.step.RunState, on its copy

    def __init__(self, extra: tuple[tuple[str, Any], ...] = ()):
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self._dists = _load_core(self.pm)
        dists, self.failed = _load_entry_points(self.pm)
        self._dists.update(dists)
        if "defaults" not in self._dists and "defaults" not in entry_points.blocked():
            raise PluginError(
                "snnfw's built-in plugins are not registered; install the package "
                "(bash scripts/install.sh, or pip install -e .) so its entry points exist"
            )
        for name, plugin in _named_plugins():
            _register(self.pm, plugin, name, f"plugin {name!r} ({ENV_PLUGINS})", f"take it out of {ENV_PLUGINS}")
        for name, plugin in extra:
            _register(self.pm, plugin, name, f"plugin {name!r} (registered in-process)")
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as err:
            name = self.pm.get_name(err.plugin)
            raise PluginError(f"plugin {name!r} implements a hook that does not exist: {err}") from None
        self.hook = _Hooks(self)
        self.registries = {kind: Registry(kind, ("auto",) if kind == "strategy" else (), tuple(self.failed.values()))
                           for kind in _REGISTRATION_HOOKS}
        for kind, hook_name in _REGISTRATION_HOOKS.items():
            registry = self.registries[kind]
            impls = getattr(self.pm.hook, hook_name).get_hookimpls()
            for impl in impls:
                try:
                    impl.function(register=registry.registrar(impl.plugin_name))
                except Exception as err:
                    self.blame(err, hook_name, impls)
                    raise
        self.overridden = self._unload_overridden()
        self._strategy_objects = self._register_strategy_objects()
        self._scoped: dict[tuple[str, str], Any] = {}

    @property
    def context(self) -> Context:
        """What a hook receives as ``hooks``: the run's state, the registries and the hooks a strategy chains."""
        return Context(self)

    def for_run(self, run) -> "Plugins":
        """This facade for one run: the hooks it calls see ``run`` as ``hooks.run``."""
        view = copy.copy(self)
        view.run = run
        view.hook = _Hooks(view)
        return view

    def _unload_overridden(self) -> dict[str, tuple[str, ...]]:
        """Unregisters plugins all of whose names were overridden; returns {plugin: plugins that override it}."""
        entries = [e for registry in self.registries.values() for e in registry.entries()]
        losers = [e for registry in self.registries.values() for e in registry.losers]
        kept = {e.plugin for e in entries}
        overridden: dict[str, tuple[str, ...]] = {}
        for name in {e.plugin for e in losers} - kept:
            overridden[name] = tuple(sorted({e.plugin for e in entries if e.replaced == name}))
            self.pm.unregister(name=name)
        return overridden

    def _register_strategy_objects(self) -> dict[str, Any]:
        """Registers each strategy object that implements hooks under ``strategy:NAME``; returns them by name."""
        objects = {}
        for entry in self.strategies.entries():
            if entry.value is None or not any(self.pm.parse_hookimpl_opts(entry.value, attr) for attr in dir(entry.value)):
                continue
            if any(entry.value is other for other in objects.values()):
                raise PluginError(f"plugin {entry.plugin!r} registers one object for two strategies; each strategy "
                                  f"needs an object of its own (register(..., {type(entry.value).__name__}()))")
            _register(self.pm, entry.value, f"{STRATEGY_PREFIX}{entry.name}",
                      f"strategy object {entry.name!r} of plugin {entry.plugin!r}", f"uninstall plugin {entry.plugin!r}")
            objects[entry.name] = entry.value
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as err:
            raise PluginError(f"strategy object {self.pm.get_name(err.plugin)!r} implements a hook that does not "
                              f"exist: {err}") from None
        return objects

    def scoped_caller(self, hook_name: str, strategies: tuple[str, ...]):
        """The caller of ``hook_name`` for a plan of ``strategies``: every plugin, and of the strategy objects only
        theirs."""
        key = (hook_name, strategies)
        if key not in self._scoped:
            others = [obj for name, obj in self._strategy_objects.items() if name not in strategies]
            self._scoped[key] = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
        return self._scoped[key]

    def describe(self, plugin: str) -> str:
        """``'name' (distribution version)``, for messages."""
        dist = self._dists.get(plugin)
        return f"{plugin!r} ({dist.name} {dist.version})" if dist else f"{plugin!r} (registered in-process)"

    def blame(self, err: Exception, hook_name: str, impls) -> None:
        """Notes on ``err`` which plugin's ``hook_name`` raised it: the innermost implementation in its traceback."""
        if any(note.startswith("raised in plugin") for note in getattr(err, "__notes__", ())):
            return
        codes = {getattr(impl.function, "__code__", None): impl.plugin_name for impl in impls}
        culprit, frame = None, err.__traceback__
        while frame is not None:
            culprit = codes.get(frame.tb_frame.f_code, culprit)
            frame = frame.tb_next
        if culprit is not None and culprit.startswith(STRATEGY_PREFIX):  # a strategy object: the plugin that registered it
            culprit = self.strategies.entry(culprit.removeprefix(STRATEGY_PREFIX)).plugin
        if culprit is not None:
            where = f"plugin {self.describe(culprit)}, hook {hook_name}"
            err.add_note(f"raised in {where}")
            if culprit not in self._dists or self._dists[culprit].name != "snnfw":
                err.snnfw_plugin_hook = where  # the plugin's fault, not snnfw's: see plugin_hook

    @property
    def strategies(self) -> Registry:
        return self.registries["strategy"]

    def strategy(self, name: str) -> Strategy:
        """The object behind strategy ``name``: what it registered, or the defaults for one registered without."""
        return self.strategies.get(name) or Strategy()

    def kept(self, name: str):
        """What plugin ``name`` keeps for this run; None outside a trainer or before it keeps anything."""
        return self.run.kept.get(name) if self.run is not None else None

    def initial(self, name: str):
        """The initial value of the model's tensor ``name`` where this run's ranks build only their shards from a
        recorded build; None otherwise."""
        return self.run.initial(name) if self.run is not None and self.run.initial is not None else None

    @property
    def families(self) -> Registry:
        return self.registries["model family"]

    @property
    def datasets(self) -> Registry:
        return self.registries["dataset"]

    @property
    def schedules(self) -> Registry:
        return self.registries["schedule"]

    @property
    def optimizers(self) -> Registry:
        return self.registries["optimizer"]

    @property
    def losses(self) -> Registry:
        return self.registries["loss"]

    @property
    def lr_schedules(self) -> Registry:
        return self.registries["lr schedule"]

    def info(self) -> list[PluginInfo]:
        """Every loaded plugin with its distribution, version and implemented hooks."""
        out = []
        loaded = {name: plugin for name, plugin in self.pm.list_name_plugin() if plugin is not None}
        owned: dict[str, list] = {}  # plugin: its strategy objects
        for name, obj in self._strategy_objects.items():
            owned.setdefault(self.strategies.entry(name).plugin, []).append(obj)
        for name in [*loaded, *self.overridden]:
            if name.startswith(STRATEGY_PREFIX):
                continue
            dist = self._dists.get(name)
            parts = [loaded[name], *owned.get(name, ())] if name in loaded else []
            callers = [caller for part in parts for caller in self.pm.get_hookcallers(part) or ()]
            out.append(
                PluginInfo(
                    name=name,
                    distribution=dist.name if dist else "(registered in-process)",
                    version=dist.version if dist else "",
                    hooks=tuple(sorted({caller.name for caller in callers})),
                    overridden_by=self.overridden.get(name, ()),
                    core=name in CORE_PLUGINS,
                )
            )
        for name, failure in self.failed.items():
            distribution, _, version = failure.distribution.partition(" ")
            out.append(PluginInfo(name=name, distribution=distribution, version=version, hooks=(), error=failure.error))
        return sorted(out, key=lambda p: p.name)

    def registered_names(self, plugin: str) -> dict[str, list[str]]:
        return {
            kind: [f"{e.name} (overrides {e.replaced})" if e.replaced else e.name for e in reg.entries() if e.plugin == plugin]
            for kind, reg in self.registries.items()
            if any(e.plugin == plugin for e in reg.entries())
        }

    # The flow hooks, one typed method each.

    def analyze_parts(self, model, family: str) -> list:
        return self.hook.snnfw_analyze(model=model, family=family)

    def preference_defaults(self, config) -> dict:
        merged: dict = {}
        for part in self.hook.snnfw_preference_defaults(config=config):
            merged.update(part)
        return merged

    def propose(self, request) -> list:
        """Every proposal for ``request``: each strategy asked for answers with its own (:meth:`Strategy.propose`),
        every plugin through ``snnfw_plan`` (refusals of other strategies, a strategy proposed by hook); lists
        flattened."""
        answers = [self.strategy(name).propose(request) for name in self.strategies.names() if request.asks_for(name)]
        answers += self.hook.snnfw_plan(request=request)
        return [p for answer in answers if answer is not None for p in (answer if isinstance(answer, list) else [answer])]

    def transform_model(self, model, plan, example) -> None:
        self.hook.snnfw_transform_model(model=model, plan=plan, example=example, hooks=self.context)

    def transform_runs_model(self, config) -> bool:
        return any(self.hook.snnfw_transform_runs_model(config=config))

    def tune_settings(self, config, analysis, device_type: str) -> dict[str, tuple]:
        """Every plugin's values to try under ``snnfw tune``, by key (:func:`snnfw_tune_settings`)."""
        merged: dict[str, tuple] = {}
        for part in self.hook.snnfw_tune_settings(config=config, analysis=analysis, device_type=device_type):
            for key, values in part.items():
                merged[key] = (*merged.get(key, ()), *(v for v in values if v not in merged.get(key, ())))
        return merged

    def compile(self, model, plan) -> None:
        self.hook.snnfw_compile(model=model, plan=plan, hooks=self.context)

    def parallelize(self, model, plan, mesh):
        result = self.hook.snnfw_parallelize(model=model, plan=plan, mesh=mesh, hooks=self.context)
        if result is None:
            raise PluginError(f"no plugin applies strategy {plan.strategy!r}; its plugin must implement snnfw_parallelize")
        return result

    def build_optimizer(self, model, plan, mesh):
        return self.hook.snnfw_build_optimizer(model=model, plan=plan, mesh=mesh, hooks=self.context)

    def forward_backward(self, model, batches, plan):
        return self.hook.snnfw_forward_backward(model=model, batches=batches, plan=plan, hooks=self.context)

    def evaluate(self, model, frames, labels, plan):
        return self.hook.snnfw_evaluate(model=model, frames=frames, labels=labels, plan=plan, hooks=self.context)

    def time_view(self, plan, mesh) -> tuple[int, int] | None:
        return self.hook.snnfw_time_view(plan=plan, mesh=mesh)

    def sequence_view(self, plan, mesh) -> tuple[int, int] | None:
        return self.hook.snnfw_sequence_view(plan=plan, mesh=mesh, hooks=self.context)

    def step_metrics(self, plan) -> dict[str, float]:
        merged: dict[str, float] = {}
        for part in self.hook.snnfw_step_metrics(plan=plan, hooks=self.context):
            merged.update(part)
        return merged

    def step_start(self, step: int, rank: int) -> None:
        self.hook.snnfw_step_start(step=step, rank=rank, hooks=self.context)

    def results_due(self, rank: int) -> None:
        self.hook.snnfw_results_due(rank=rank)

    def rank_done(self, rank: int) -> None:
        self.hook.snnfw_rank_done(rank=rank)

    def summary(self, plan) -> dict[str, float]:
        merged: dict[str, float] = {}
        for part in self.hook.snnfw_summary(plan=plan, hooks=self.context):
            merged.update(part)
        return merged

    def state_dict(self, model, optimizer, plan) -> dict:
        return self.hook.snnfw_state_dict(model=model, optimizer=optimizer, plan=plan)

    def load_state_dict(self, model, optimizer, plan, state) -> None:
        self.hook.snnfw_load_state_dict(model=model, optimizer=optimizer, plan=plan, state=state)

    def reset_state(self, model) -> None:
        if not self.hook.snnfw_reset_state(model=model):
            raise PluginError("no plugin resets neuron state; the built-in 'defaults' plugin is blocked")

    def shard_neuron(self, module, placement, mesh):
        return self.hook.snnfw_shard_neuron(module=module, placement=placement, mesh=mesh)

    def split_stages(self, model, plan, example):
        return self.hook.snnfw_split_stages(model=model, plan=plan, example=example)

    def transform_stages(self, model, stages, local, plan) -> None:
        self.hook.snnfw_transform_stages(model=model, stages=stages, local=local, plan=plan, hooks=self.context)

    def schedule(self, stages, plan, loss_fn):
        return self.hook.snnfw_schedule(stages=stages, plan=plan, loss_fn=loss_fn, hooks=self.context)


def plugin_hook(err: BaseException) -> str:
    """``"plugin 'name' (distribution version), hook H"`` where a hook of a plugin other than snnfw's own raised
    ``err`` (:meth:`Plugins.blame`), else ``""``."""
    return getattr(err, "snnfw_plugin_hook", "")


def check_same_plugins_on_all_ranks(plugins: Plugins, group=None) -> None:
    """Fails on every rank, naming the differences, when ranks loaded different plugins (or one failed to import
    a plugin that another loaded)."""
    import torch.distributed as dist

    mine = sorted((p.name, f"{p.version} (failed to import)" if p.error else p.version) for p in plugins.info())
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    reference = set(gathered[0])
    problems = []
    for rank, theirs in enumerate(gathered[1:], start=1):
        theirs = set(theirs)
        if theirs != reference:
            only0 = ", ".join(f"{n} {v}".strip() for n, v in sorted(reference - theirs)) or "nothing"
            only_r = ", ".join(f"{n} {v}".strip() for n, v in sorted(theirs - reference)) or "nothing"
            problems.append(f"rank 0 has {only0} that rank {rank} lacks; rank {rank} has {only_r} that rank 0 lacks")
    if problems:
        raise PluginError(
            "ranks loaded different plugins: " + "; ".join(problems)
            + ". Install the same packages and set the same SNNFW_* variables on every node"
        )
