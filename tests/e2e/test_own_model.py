"""A model and data of the user's own: by import path, through the Python API, with inferred plans.

The float64 equivalence of such a model under every strategy is part of
``tests/test_guarantee.py`` (the ``own_sew`` rows); here: the API beside
``snnfw train``, export, rank 0's initial state for a handed-over module,
what is inferred, and the refusals that name the key to set.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snnfw.config import build_config
from snnfw.errors import ConfigError, UserError
from snnfw.model.source import infer_tp_plan
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import RankFailure, run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_own_model.py"
OWN = {"builder": f"{EXAMPLE}:build", "input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN"}
TIMEOUT_S = 240


def own_config(**sections):
    data = {"model": dict(OWN), "data": {"batch_size": 8, "train_samples": 32, "test_samples": 16}, "train": {"steps": 2}}
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return build_config(data)


def example_module():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_own_model

        return train_own_model
    finally:
        sys.path.remove(str(EXAMPLE.parent))


def test_the_api_example_and_snnfw_train_give_the_same_losses_and_an_export_the_module_loads(tmp_path):
    steps = "8"
    api = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE), "--strategy", "fsdp2",
           "--steps", steps, "--out", str(tmp_path / "api.json"), "--export", str(tmp_path / "net.pt"),
           "--run-dir", str(tmp_path / "api")]
    cli = [sys.executable, "-m", "snnfw", "train", str(ROOT / "examples" / "own_model.toml"), "--nproc", "2",
           "--set", "parallel.strategy=fsdp2", "--set", f"train.steps={steps}", "--run-dir", str(tmp_path / "cli")]
    for command in (api, cli):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
    from_api = json.loads((tmp_path / "api.json").read_text())
    from_cli = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert from_api["losses"] == from_cli["losses"] and len(from_api["losses"]) == 8
    assert from_api["test_accuracy"] == from_cli["test_accuracy"]
    api_summary = json.loads((tmp_path / "api" / "summary.json").read_text())  # the API writes its run directory too
    assert api_summary["losses"] == from_cli["losses"] and api_summary["plan"]["preset"] == "fsdp2"
    api_records = [json.loads(line) for line in (tmp_path / "api" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in api_records] == from_cli["losses"] and api_records[-1]["eval_acc"] == from_api["test_accuracy"]
    final = torch.load(tmp_path / "cli" / "final_model.pt", weights_only=True)  # what every run leaves behind
    exported = torch.load(tmp_path / "net.pt", weights_only=True)
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)
    net = example_module().build()
    fresh = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    net.load_state_dict(torch.load(tmp_path / "net.pt", weights_only=True), strict=True)
    assert not torch.equal(net.state_dict()["6.weight"], fresh["6.weight"]), "the export holds the initial weights"
    # BatchNorm statistics as none's with one microbatch per replica chunk: 8 steps x 2 replicas
    assert net.state_dict()["0.1.num_batches_tracked"].item() == 16


HANDED_OVER = """
import torch, torch.distributed as dist, sys
sys.path.insert(0, {folder!r})
import snnfw, train_own_model as example

torch.manual_seed(int(__import__("os").environ["RANK"]))  # every rank builds a different instance
net = example.build()
config = {{"model": {{"input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN"}},
          "data": {{"batch_size": 8}}, "parallel": {{"strategy": "dp"}}, "train": {{"steps": 1}}}}
train, test = example.datasets()
with snnfw.start(config, model=net, train_set=train, test_set=test) as run:
    before = run.model.state_dict()  # this rank's replica
    parts = [None, None]
    dist.all_gather_object(parts, before)
    assert all(torch.equal(parts[0][k], parts[1][k]) for k in before), "ranks start from different states"
    run.step(0)
    print("same start", flush=True)
"""


def test_a_handed_over_module_starts_from_rank_0s_state_on_every_rank(tmp_path):
    script = tmp_path / "handed_over.py"
    script.write_text(HANDED_OVER.format(folder=str(EXAMPLE.parent)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("same start") == 2


def test_what_snnfw_infers_for_the_sew_network():
    analysis = prepare(own_config(), 1, Plugins()).analysis
    assert analysis.own and set(analysis.inferred) == {"blocks", "stage_units", "tp_plan"}
    assert analysis.blocks == ("0", "1", "3", "6")  # the children with parameters
    assert analysis.stage_units == tuple(str(i) for i in range(7))  # the children of the nn.Sequential
    # each Conv-BN-LIF container, the residual blocks' inner ones included: their outputs are whole
    assert analysis.tp_plan == (("0", "conv_bn_neuron"), ("1.conv", "conv_bn_neuron"), ("3.conv", "conv_bn_neuron"))
    flat = torch.nn.Sequential(torch.nn.Flatten(), *example_module().build()[0], torch.nn.Flatten(), torch.nn.Linear(4, 2))
    assert infer_tp_plan(flat) == (("1:4", "conv_bn_neuron"),)  # ungrouped layers: the run of them, as a slice


def test_a_declared_plan_replaces_the_inferred_one():
    config = own_config(model={"blocks": ["1", "3"], "tp_plan": {"1.conv": "conv_bn_neuron"}})
    analysis = prepare(config, 1, Plugins()).analysis
    assert analysis.blocks == ("1", "3") and analysis.tp_plan == (("1.conv", "conv_bn_neuron"),)
    assert analysis.inferred == ("stage_units",)


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"model": {"family": "cifar10dvs_vgg"}}, "model.family"),
        ({"model": {"input_shape": None}}, "model.input_shape"),
        ({"model": {"builder": f"{EXAMPLE}:nothing"}}, "has no 'nothing'"),
        ({"model": {"builder": "no_such_module_here:build"}}, "cannot import"),
        ({"model": {"blocks": ["9"]}}, "model.blocks names '9'"),
        ({"model": {"stage_units": ["0", "squash:6"]}}, "model.stage_units names 'squash:6', whose glue 'squash'"),
        ({"model": {"stage_units": ["0", "flatten:9"]}}, "model.stage_units names 'flatten:9', which the model has not"),
        ({"data": {"builder": f"{EXAMPLE}:datasets", "name": "synthetic_dvs"}}, "data.name"),
        ({"parallel": {"strategy": "tp"}, "model": {"tp_plan": {}}}, "model.tp_plan"),
        ({"parallel": {"strategy": "pp"}, "model": {"stage_units": []}}, "model.stage_units"),
    ],
)
def test_mistakes_with_an_own_model_name_the_key(sections, needle):
    data = {"model": dict(OWN), "data": {"batch_size": 8}, "train": {"steps": 2}}
    for section, values in sections.items():
        data[section] = {key: value for key, value in {**data.get(section, {}), **values}.items() if value is not None}
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        prepare(build_config(data), 2, Plugins())


def test_own_model_keys_are_refused_under_a_family():
    with pytest.raises(ConfigError, match=r"model\.input_layout"):
        prepare(build_config({"model": {"input_layout": "TN"}}), 1, Plugins())


def test_frames_that_do_not_match_the_model_are_refused():
    config = build_config({"model": {**OWN, "time_steps": 3}, "data": {"builder": f"{EXAMPLE}:datasets"}, "train": {"steps": 1}})
    with pytest.raises(ConfigError, match=r"\[T, C, H, W\] = \[3, 2, 16, 16\]"):
        run_training(config)


def test_stage_units_that_do_not_compute_the_model_are_refused():
    # without unit 2 (the max pooling) the units still run one after another, but compute another function
    units = ["0", "1", "3", "4", "5", "6"]
    config = own_config(model={"stage_units": units}, parallel={"strategy": "pp"}, train={"microbatches": 2})
    with pytest.raises(RankFailure, match="do not compute the model's output"):
        run_on_ranks(config, 2, timeout_s=TIMEOUT_S)


def test_stage_units_out_of_order_are_refused_by_what_the_unit_raised():
    """Units in the wrong order raise whatever their layers raise (SpikingJelly's shape check: ValueError); the
    check turns it into the refusal, naming the unit."""
    from spikingjelly.activation_based import functional

    from snnfw_plugins.strategies.pp_stages import composition_error

    model = example_module().build()
    units = dict(model.named_children())
    flatten_before_pool = [units[name] for name in ("0", "1", "2", "3", "5", "4", "6")]
    error = composition_error(model, flatten_before_pool, torch.rand(4, 2, 2, 16, 16), functional.reset_net)
    assert "unit 6 of 7 (AdaptiveAvgPool2d) raised ValueError" in error and "model.stage_units" in error


class Cycle:
    """Garbage that only the collector frees: it refers to itself."""

    def __init__(self):
        self.me = self


@pytest.mark.parametrize("freeze_above", [None, 0], ids=["eager", "many-objects"])
def test_a_session_keeps_what_was_alive_before_it_out_of_collections_and_frees_its_model(freeze_above, monkeypatch):
    """Before the session, the caller's objects leave the collector's scans; after the first step, the objects it
    left alive do too when there are many (compiled code; here any number, with ``FREEZE_ABOVE`` at 0). Garbage
    the session makes is still collected, and closing it frees its model and gives every object back."""
    import gc
    import weakref

    import snnfw
    from snnfw.run.session import Session

    if freeze_above is not None:
        monkeypatch.setattr(Session, "FREEZE_ABOVE", freeze_above)
    assert gc.get_freeze_count() == 0
    with snnfw.start(own_config()) as run:
        before = gc.get_freeze_count()
        assert before > 10_000, f"{before} objects alive before the session (torch's modules) left out of collections"
        model = weakref.ref(run.model)
        run.step(0)
        frozen = gc.get_freeze_count()
        if freeze_above is None:
            assert frozen <= before, f"{frozen - before} objects of an eager tiny session frozen after its first step"
        else:
            assert frozen > before, "the objects the first step left alive are frozen"
        garbage = Cycle()
        gone = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert gone() is None, "garbage made after the first step is still collected"
        run.step(1)
        assert gc.get_freeze_count() <= frozen, "only the first step freezes (frozen objects that die leave)"
    assert model() is None, "closing the session frees its model"
    assert gc.get_freeze_count() == 0, "closing the session gives the frozen objects back to the collector"


def test_a_script_started_without_torchrun_is_told_how_to_launch(monkeypatch):
    import snnfw

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match=r"not started by torchrun.*launch it with `torchrun --nproc_per_node=2 \S+`$"):
        with snnfw.start(own_config(parallel={"strategy": "fsdp2"})):
            pass


def test_a_session_names_its_rank_and_writes_its_run_directory(tmp_path, monkeypatch, capsys):
    import snnfw

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with snnfw.start(own_config(train={"steps": 2, "log_every": 1}), run_dir=tmp_path / "run") as run:
        records = [run.step(step) for step in range(2)]
        scores = run.evaluate()
    assert (run.rank, run.world_size) == (0, 1)  # still there after the session
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in written] == [r["loss"] for r in records] and written[-1]["eval_acc"] == scores["eval_acc"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["losses"] == [r["loss"] for r in records] and summary["test_accuracy"] == scores["eval_acc"]
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[snnfw] step")]
    assert [line.split()[2] for line in progress] == ["1/2", "2/2"] and progress[-1].endswith(f"| eval {scores['eval_acc']:.1%}")


SIBLING_NET = '''
from torch import nn
from spikingjelly.activation_based import layer, neuron
from blocks import WIDTH  # a module beside this file, as a script imports it


def build():
    return nn.Sequential(layer.Flatten(step_mode="m"), layer.Linear(2 * 16 * 16, WIDTH, step_mode="m"),
                         neuron.LIFNode(step_mode="m"), layer.Linear(WIDTH, 10, step_mode="m"))
'''


def test_a_builder_file_starts_at_its_config_file_and_imports_what_lies_beside_it(tmp_path, monkeypatch):
    from snnfw.config import load_config

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "net.py").write_text(SIBLING_NET)
    (folder / "blocks.py").write_text("WIDTH = 32\n")
    (folder / "my.toml").write_text('[model]\nbuilder = "net.py:build"\ninput_shape = [2, 16, 16]\nnum_classes = 10\n'
                                    'input_layout = "TN"\n')
    monkeypatch.chdir(tmp_path)  # not the config's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = load_config(folder / "my.toml")
    assert config.model.builder == f"{folder / 'net.py'}:build"
    assert prepare(config, 1, Plugins()).analysis.parameters == 2 * 16 * 16 * 32 + 32 + 32 * 10 + 10
