"""Every hook specification is typed, documented in the plugin guide and implemented by a built-in or test plugin;
a hook receives a narrow, typed context as ``hooks``, and the duck types the core looks for are protocols."""

import inspect
import re
from pathlib import Path

import pytest

from snnfw.api import EventAugmented, HookContext, ShardedNeuron, SlicedParameters, TimeSliced
from snnfw.plugin import hookspecs
from snnfw.plugin.manager import Plugins

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("snnfw_")]
SOURCES = [p.read_text() for folder in ("plugins", "tests", "examples", "snnfw/testing") for p in (ROOT / folder).rglob("*.py")]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_and_implemented(hook):
    assert inspect.getdoc(getattr(hookspecs, hook)), f"{hook} has no docstring"
    assert f"`{hook}`" in (ROOT / "docs" / "plugins.md").read_text(), f"{hook} is missing from docs/plugins.md"
    pattern = re.compile(rf"def {hook}\(")
    assert any(pattern.search(source) for source in SOURCES), f"no plugin implements {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_specification_is_annotated(hook):
    signature = inspect.signature(getattr(hookspecs, hook))
    assert signature.return_annotation is not inspect.Signature.empty, f"{hook} does not say what it returns"
    assert [p.name for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty] == []


def test_a_hook_sees_only_what_its_context_offers():
    plugins = Plugins()
    context = plugins.context
    offered = [name for name in vars(HookContext) if not name.startswith("_")]
    assert {"run", "strategy", "compile", "reset_state", "shard_neuron", "schedules"} <= set(offered)
    assert context.strategy("dp") is plugins.strategy("dp") and context.optimizers is plugins.optimizers
    for internal in ("pm", "hook", "registries", "parallelize", "for_run"):
        with pytest.raises(AttributeError, match=rf"a hook's context has no '{internal}'; it offers run, strategies, families"):
            getattr(context, internal)
    with pytest.raises(AttributeError, match="read-only; keep what a plugin needs for the run in hooks.run.kept"):
        context.run = None
    assert plugins.for_run("the run's state").context.run == "the run's state"


def test_the_marks_and_data_set_offers_are_protocols():
    class Neuron:
        snnfw_shard = "placement"

    class Sliced:
        snnfw_slices = {"weight": "piece"}

    class Frames:
        def time_slice(self, index, start, stop):
            return None

        def with_events(self, index, names, options, seed):
            return None

    assert isinstance(Neuron(), ShardedNeuron) and not isinstance(Frames(), ShardedNeuron)
    assert isinstance(Sliced(), SlicedParameters) and not isinstance(Neuron(), SlicedParameters)
    assert isinstance(Frames(), TimeSliced) and isinstance(Frames(), EventAugmented)
    assert not isinstance(Neuron(), TimeSliced) and not isinstance(Sliced(), EventAugmented)
