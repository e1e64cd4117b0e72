"""Plugin manager: entry-point loading, blocking, autoload switch, misspelt hooks, clashes, rank consistency; keys
plugins add to the core's config sections."""

import pickle
import sys

import pytest

import snnfw
from snnfw.config import build_config
from snnfw import entry_points
from snnfw.entry_points import ENV_BLOCK, ENV_DISABLE_AUTOLOAD, GROUP, SECTIONS_GROUP
from snnfw.errors import ConfigError, PluginError
from snnfw.plugin.manager import Plugins
from snnfw.testing import RankFailure, run_on_ranks, tiny_config
from snnfw.testing.distribution import install_distribution

BUILTINS = {"defaults", "none", "dp", "zero", "tp", "cifar10dvs_vgg", "synthetic_dvs"}


def install_fake_distribution(tmp_path, monkeypatch, module_source, name="snnfw_fake", entry="fake"):
    """A distribution with an ``snnfw`` entry point named ``entry``."""
    install_distribution(tmp_path, monkeypatch, name, module_source, {GROUP: {entry: name}}, version="0.3")


FAKE = """
    from snnfw import hookimpl

    @hookimpl
    def snnfw_register_datasets(register):
        register("fake_set", object(), "a data set from outside snnfw")
"""


def test_builtins_load_through_entry_points():
    plugins = Plugins()
    info = {p.name: p for p in plugins.info()}
    assert BUILTINS <= set(info)
    assert info["dp"].distribution == "snnfw"
    assert "snnfw_parallelize" in info["mesh"].hooks and "snnfw_build_optimizer" in info["zero"].hooks
    assert {"dp", "none", "mesh", "tp"} <= set(plugins.strategies.names())
    assert plugins.registered_names("synthetic_dvs") == {"dataset": ["synthetic_dvs"]}


def test_third_party_entry_point_is_loaded(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, FAKE)
    plugins = Plugins()
    assert "fake_set" in plugins.datasets.names()
    info = {p.name: p for p in plugins.info()}
    assert (info["fake"].distribution, info["fake"].version) == ("snnfw_fake", "0.3")


def test_blocking_and_disabling_autoload(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, FAKE)
    monkeypatch.setenv(ENV_BLOCK, "fake,tp")
    plugins = Plugins()
    assert "fake_set" not in plugins.datasets.names()
    assert "tp" not in plugins.strategies.names() and "dp" in plugins.strategies.names()
    monkeypatch.delenv(ENV_BLOCK)
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    plugins = Plugins()
    assert "fake_set" not in plugins.datasets.names()
    assert BUILTINS <= {p.name for p in plugins.info()}


def test_misspelt_hook_fails_at_load(tmp_path, monkeypatch):
    install_fake_distribution(
        tmp_path,
        monkeypatch,
        """
        from snnfw import hookimpl

        @hookimpl
        def snnfw_plann(request):
            return None
        """,
    )
    with pytest.raises(PluginError, match="'fake' implements a hook that does not exist"):
        Plugins()


def test_two_plugins_registering_one_name_fail_with_both_names(tmp_path, monkeypatch):
    install_fake_distribution(
        tmp_path,
        monkeypatch,
        """
        from snnfw import hookimpl

        @hookimpl
        def snnfw_register_strategies(register):
            register("dp", None, "another dp")
        """,
    )
    with pytest.raises(PluginError, match="strategy 'dp' is registered by two plugins, 'dp' and 'fake'"):
        Plugins()


def test_an_entry_point_named_like_a_builtin_fails_naming_both(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, FAKE, entry="tp")
    with pytest.raises(PluginError) as err:
        Plugins()
    message = str(err.value)
    assert "two plugins have the entry-point name 'tp'" in message
    assert "snnfw_plugins.strategies.tp (snnfw " in message and "snnfw_fake (snnfw_fake 0.3)" in message
    assert "overrides=True" in message
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")  # the third-party one is not loaded: the built-in stays
    assert "tp" in Plugins().strategies.names()


def test_the_composition_is_a_plugin_of_the_core_registered_without_an_entry_point():
    from snnfw.plan.composed import Composed

    plugins = Plugins()
    info = {p.name: p for p in plugins.info()}
    assert (info["mesh"].distribution, info["mesh"].version, info["mesh"].core) == ("snnfw", snnfw.__version__, True)
    assert not info["dp"].core and type(plugins.strategy("mesh")) is Composed
    assert "mesh" not in {ep.name for ep in entry_points.installed(GROUP)}


def test_the_core_plugin_is_never_blocked_and_no_entry_point_takes_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_BLOCK, "tp,mesh")
    with pytest.raises(PluginError, match="SNNFW_BLOCK_PLUGINS names 'mesh', a plugin of snnfw's core that is always "
                                          "loaded; take it out of SNNFW_BLOCK_PLUGINS"):
        Plugins()
    monkeypatch.delenv(ENV_BLOCK)
    install_fake_distribution(tmp_path, monkeypatch, FAKE, entry="mesh")
    with pytest.raises(PluginError, match=r"the entry point snnfw_fake \(snnfw_fake 0.3\) takes the name 'mesh' of a "
                                          "plugin of snnfw's core; rename it"):
        Plugins()


def test_ranks_with_different_plugins_fail_naming_the_difference():
    with pytest.raises(RankFailure) as err:
        run_on_ranks(tiny_config("dp"), 2, env={1: {ENV_BLOCK: "neuromorphic"}}, timeout_s=120)
    text = str(err.value)
    assert "ranks loaded different plugins" in text
    assert f"rank 0 has neuromorphic {snnfw.__version__} that rank 1 lacks" in text


OVERRIDE_NONE = """
    from snnfw import hookimpl
    from snnfw.plan.layout import Proposal

    @hookimpl
    def snnfw_register_strategies(register):
        register("none", None, "a replacement for none", overrides={overrides})

    @hookimpl
    def snnfw_plan(request):
        if request.asks_for("none"):
            return Proposal("none", mesh=(("dp", 1),), dp_dims=("dp",), rationale=("the replacement plans",))
"""


def test_declared_override_replaces_the_builtin_and_unloads_it(tmp_path, monkeypatch):
    from snnfw.plan.prepare import prepare

    install_fake_distribution(tmp_path, monkeypatch, OVERRIDE_NONE.format(overrides=True))
    plugins = Plugins()
    entry = plugins.strategies.entry("none")
    assert (entry.plugin, entry.replaced, entry.description) == ("fake", "none", "a replacement for none")
    assert plugins.pm.get_plugin("none") is None
    assert {p.name: p.overridden_by for p in plugins.info()}["none"] == ("fake",)
    assert prepare(tiny_config("none"), 1, plugins).plan.rationale[0] == "the replacement plans"


def test_override_declared_twice_fails(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, OVERRIDE_NONE.format(overrides=True))
    clash = "from snnfw import hookimpl\n@hookimpl\ndef snnfw_register_strategies(register):\n    register('none', None, overrides=True)\n"
    with pytest.raises(PluginError, match="'fake' and 'clash', and both declare overrides=True"):
        Plugins(extra=(("clash", _module("clash", clash)),))


def _module(name, source):
    import types

    module = types.ModuleType(name)
    exec(source, module.__dict__)
    return module


def test_exception_in_a_hook_names_plugin_and_distribution(tmp_path, monkeypatch):
    from snnfw.errors import PlanError, explain
    from snnfw.plan.prepare import prepare

    install_fake_distribution(
        tmp_path,
        monkeypatch,
        """
        from snnfw import hookimpl
        from snnfw.errors import PlanError

        def check(request):
            raise PlanError("the fake planner refuses")

        @hookimpl
        def snnfw_plan(request):
            check(request)

        @hookimpl
        def snnfw_analyze(model, family):
            return {}["no such key"]
        """,
    )
    plugins = Plugins()
    with pytest.raises(KeyError) as err:
        prepare(tiny_config("none"), 1, plugins)
    assert err.value.__notes__ == ["raised in plugin 'fake' (snnfw_fake 0.3), hook snnfw_analyze"]
    plugins.pm.unregister(plugins.pm.get_plugin("fake"))
    plugins.pm.register(_module("planner", "from snnfw import hookimpl\nfrom snnfw.errors import PlanError\n"
                                            "@hookimpl\ndef snnfw_plan(request):\n    raise PlanError('no plan today')\n"),
                        name="planner")
    with pytest.raises(PlanError) as err:
        prepare(tiny_config("none"), 1, plugins)
    assert explain(err.value) == "no plan today; raised in plugin 'planner' (registered in-process), hook snnfw_plan"


def test_loading_every_plugin_imports_neither_torch_nor_spikingjelly():
    """What keeps `snnfw plugins` fast: plugins import torch inside the hooks that need it."""
    import subprocess

    code = ("import sys; from snnfw.plugin.manager import Plugins; Plugins(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'spikingjelly'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


SCOPED = """
    from snnfw.api import Strategy, hookimpl

    CALLS = []

    class Mine(Strategy):
        @hookimpl
        def snnfw_step_metrics(self, plan):
            CALLS.append(plan.strategy)
            return {"mine": 1.0}

        @hookimpl
        def snnfw_summary(self, plan):
            raise RuntimeError("mine fails")

    @hookimpl
    def snnfw_register_strategies(register):
        register("mine", Mine(), "a strategy whose object owns its hooks")
"""


def test_a_strategy_objects_hooks_run_only_for_a_plan_of_its_strategy(tmp_path, monkeypatch):
    """No ``plan.strategy`` guard in the plugin: the manager leaves other strategies' objects out of the call, and
    an error in the object's hook names the plugin that registered it."""
    import types

    install_fake_distribution(tmp_path, monkeypatch, SCOPED, name="snnfw_mine", entry="mine")
    plugins = Plugins()
    module = sys.modules["snnfw_mine"]
    def plan(strategy):
        log = types.SimpleNamespace(phase_times=False)
        return types.SimpleNamespace(strategy=strategy, mesh=(("dp", 2),), config=types.SimpleNamespace(log=log))

    assert plugins.step_metrics(plan("dp")) == {}
    assert plugins.step_metrics(plan("mine")) == {"mine": 1.0}
    assert module.CALLS == ["mine"]
    assert "snnfw_step_metrics" in {p.name: p for p in plugins.info()}["mine"].hooks
    with pytest.raises(RuntimeError) as err:
        plugins.summary(plan("mine"))
    assert err.value.__notes__ == ["raised in plugin 'mine' (snnfw_mine 0.3), hook snnfw_summary"]


KEYS = """
    import attrs

    @attrs.frozen
    class ParallelKeys:
        cap_mb: float = attrs.field(default=25.0, validator=attrs.validators.gt(0))

    @attrs.frozen
    class Again:
        zero: bool = False
"""


def test_a_plugin_adds_keys_to_a_core_section(tmp_path, monkeypatch):
    install_distribution(tmp_path, monkeypatch, "snnfw_keys", KEYS, {GROUP: {"keys": "snnfw_keys"},
                                                                      SECTIONS_GROUP: {"parallel.keys": "snnfw_keys:ParallelKeys"}})
    config = build_config({"parallel": {"cap_mb": 2.0, "zero": True}})
    assert (config.parallel.cap_mb, config.parallel.zero, config.parallel.strategy) == (2.0, True, "none")
    assert "parallel.cap_mb" in config.explicit
    assert build_config(config.to_dict()) == config == pickle.loads(pickle.dumps(config))
    assert build_config({}).parallel.cap_mb == 25.0
    with pytest.raises(ConfigError, match=r"invalid value in \[parallel\]: 'cap_mb' must be > 0"):
        build_config({"parallel": {"cap_mb": 0}})
    monkeypatch.setenv(ENV_BLOCK, "keys,zero")
    with pytest.raises(ConfigError, match="unknown config key parallel.cap_mb"):
        build_config({"parallel": {"cap_mb": 2.0}})
    with pytest.raises(ConfigError, match="unknown config key parallel.zero"):
        build_config({"parallel": {"zero": True}})


def test_a_key_added_twice_to_a_section_is_refused_naming_the_class(tmp_path, monkeypatch):
    install_distribution(tmp_path, monkeypatch, "snnfw_keys", KEYS, {SECTIONS_GROUP: {"parallel.keys": "snnfw_keys:Again"}})
    with pytest.raises(ConfigError, match="ZeroKeys adds key 'zero' to a section where snnfw_keys.Again has it already"):
        build_config({})
