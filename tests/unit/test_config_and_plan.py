"""Config loading, overrides and plan validation: each bad request raises its named error."""

import re

import pytest

from snnfw.config import ConfigError, build_config, load_config, parse_override
from snnfw.errors import PlanError, UnknownNameError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config
from snnfw.testing.equivalence import CASES, FAMILIES, case_config


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


def test_quickstart_config_loads_with_overrides():
    config = load_config("examples/quickstart.toml", ["train.steps=7", "parallel.mesh={dp = 2}", "model.flavor=full"])
    assert config.train.steps == 7
    assert config.parallel.mesh == (("dp", 2),)
    assert config.model.flavor == "full"
    assert config.parallel.strategy == "dp"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": {"stpes": 3}}, "unknown config key train.stpes"),
        ({"trian": {}}, "unknown config section [trian]"),
        ({"train": {"steps": "3"}}, "train.steps must be an integer, got '3' (str)"),
        ({"train": {"steps": True}}, "train.steps must be an integer, got True (bool)"),
        ({"train": {"lr": "fast"}}, "train.lr must be a number, got 'fast' (str)"),
        ({"parallel": {"zero": 1}}, "parallel.zero must be true or false, got 1 (int)"),
        ({"checkpoint": {"keep": 3}}, "checkpoint.keep applies only when checkpoints are written (checkpoint.every > 0"),
        ({"checkpoint": {"every": 0, "keep": 2}}, "set checkpoint.every, or remove checkpoint.keep"),
        ({"train": {"steps": 0}}, "'steps' must be > 0"),
        ({"parallel": {"mesh": {"dp": 0}}}, "parallel.mesh.dp = 0: a dimension's size is its number of ranks"),
        ({"log": {"profile": {"steps": "3-2"}}}, 'log.profile.steps must be a step or a range of steps counted from 1'),
        ({"log": {"profile": {"steps": 2, "ranks": "some"}}}, 'log.profile.ranks must be "all" or a list of ranks'),
        ({"log": {"profile": {"ranks": [0]}}}, 'log.profile must be a table like {steps = "10-12", ranks = "all"}'),
        ({"log": {"profile": {"steps": "9-12"}}, "train": {"steps": 10}}, "log.profile.steps ends at step 12, after the run's last, step 10"),
        ({"data": {"frames": {"by": "events"}}}, "invalid data.frames: 'by' must be in ('count', 'time')"),
        ({"data": {"frames": "time"}}, 'data.frames must be a table like {by = "time"} with keys by, denoise_us'),
    ],
)
def test_bad_config_is_refused_by_name(data, message):
    with pytest.raises(ConfigError) as err:
        build_config(data)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "data, overrides, message",
    [({"train": {"stpes": 3}}, [], r"unknown config key train.stpes \(did you mean train.steps\?\); keys of \[train\] are "),
     ({"trian": {}}, [], r"unknown config section \[trian\] \(did you mean \[train\]\?\); sections are model, "),
     ({}, ["trian.steps=3"], r"unknown config section in --set 'trian.steps=3' \(did you mean train\?\); sections are "),
     ({"train": {"zzz": 3}}, [], r"unknown config key train.zzz; keys of \[train\] are ")],
)
def test_a_mistyped_key_or_section_is_refused_with_the_nearest_name(data, overrides, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        build_config(data, overrides)


@pytest.mark.parametrize(
    "override, message",
    [('train.lr="fast"', "train.lr must be a number, got 'fast' (str)"),
     ('train.steps="ten"', "train.steps must be an integer, got 'ten' (str)")],
)
def test_an_override_of_the_wrong_type_names_the_key_and_the_type(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("examples/quickstart.toml", [override])
    assert str(err.value) == message
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0  # an integer is a number


def test_the_keys_the_user_set_are_tracked_through_a_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[parallel]\nstrategy = "dp"\nzero = false\n')
    config = load_config(path, ["pipeline.schedule=1f1b"])
    assert config.explicit == {"parallel.strategy", "parallel.zero", "pipeline.schedule"}
    assert build_config(config.to_dict()) == config
    assert build_config(config.to_dict(), ["train.lr=0.1"]).explicit == config.explicit | {"train.lr"}
    with pytest.raises(ConfigError, match="explicit lists unknown config keys train.stpes"):
        build_config({"explicit": ["train.stpes"]})


def test_checkpoint_keep_is_taken_with_checkpoints():
    assert build_config({"checkpoint": {"every": 2, "keep": 3}}).checkpoint.keep == 3


def test_override_values_are_read_as_toml_else_as_strings():
    assert parse_override("train.lr=0.5") == ("train", "lr", 0.5)
    assert parse_override("model.flavor=tiny") == ("model", "flavor", "tiny")
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("steps=3")


@pytest.mark.parametrize("value, reason", [("{tp=2,tp=4}", "Duplicate inline table key 'tp'"),
                                           ("{dp = 2, tp = 2", "Unclosed inline table")])
def test_an_override_table_that_is_not_toml_is_refused_not_read_as_a_string(value, reason):
    with pytest.raises(ConfigError, match=rf"^--set 'parallel.mesh={re.escape(value)}' is not a TOML table or array: "
                                          rf"{reason}; write each key once and close each bracket, or put TOML quotes "
                                          r"around a string$"):
        load_config("examples/quickstart.toml", [f"parallel.mesh={value}"])


def test_missing_config_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "config, world, error, message",
    [
        (tiny_config("none", model={"family": "resnet"}), 1, UnknownNameError, "registered model family names: cifar10dvs_vgg"),
        (tiny_config("none", model={"flavor": "huge"}), 1, UnknownNameError, "flavors: full, tiny"),
        (tiny_config("none", data={"name": "mnist"}), 1, UnknownNameError,
         "unknown dataset 'mnist' (did you mean 'n_mnist'?); registered dataset names: asl_dvs, cifar10, cifar100, "
         "cifar10_dvs, dvs128_gesture, dvs_lip, image_folder, n_caltech101, n_mnist, python_bytes, shd, ssc, synthetic_dvs"),
        (tiny_config("none"), 2, PlanError, "use --nproc 1"),
        (tiny_config("dp"), 1, PlanError, "at least 2 ranks"),
        (tiny_config("dp"), 3, PlanError, "divisible by data-parallel size 3"),
        (tiny_config("dp", microbatches=3), 2, PlanError, "train.microbatches 3"),
        (tiny_config("dp", parallel={"mesh": {"dp": 4}}), 2, PlanError, "mesh dp_replicate=4 has 4 ranks but the world has 2"),
        (tiny_config("dp", parallel={"mesh": {"tp": 2}}), 2, PlanError, "strategy dp splits over dp_replicate, 2 ranks or "
                                                                         "more each, and its mesh {tp = 2} names no dp_replicate"),
        (tiny_config("fsdp2_tp"), 2, PlanError, "and 2 ranks give it dp_shard = 1; launch with --nproc 4 or more"),
        (tiny_config("none", parallel={"mesh": {"tp": 1}}), 1, PlanError,
         "strategy 'none' cannot run: its mesh is {dp = 1}, got {'tp': 1}; remove parallel.mesh"),
    ],
)
def test_impossible_requests_fail_in_plan(plugins, config, world, error, message):
    with pytest.raises(error) as err:
        prepare(config, world, plugins)
    assert message in str(err.value)


def test_none_plans_with_its_own_mesh(plugins):
    assert prepare(tiny_config("none", parallel={"mesh": {"dp": 1}}), 1, plugins).plan.mesh == (("dp", 1),)


def test_unknown_strategy_lists_every_registered_one_and_preset_and_auto_and_the_closest(plugins):
    from snnfw.plan.presets import PRESETS

    with pytest.raises(UnknownNameError) as err:
        prepare(tiny_config("fsdp9"), 2, plugins)
    names = sorted({*plugins.strategies.names(), *PRESETS})
    assert {"none", "dp", "zero", "tp", "fsdp2_tsp", "mesh"} <= set(names)
    assert str(err.value) == (f"unknown strategy 'fsdp9' (did you mean 'fsdp2'?); strategies and presets: "
                              f"{', '.join(names)}, auto")
    with pytest.raises(UnknownNameError, match=r"^unknown strategy 'xyzzy'; strategies and presets: .*, auto$"):
        prepare(tiny_config("xyzzy"), 2, plugins)


def test_plan_records_layout_and_rationale(plugins):
    plan = prepare(tiny_config("dp", microbatches=2), 2, plugins).plan
    assert (plan.dp_size, plan.replica_batch, plan.microbatch_size) == (2, 4, 2)
    assert plan.backend == "gloo" and plan.mesh == (("dp_replicate", 2),)
    assert (plan.strategy, plan.preset, plan.strategies) == ("mesh", "dp", ("dp",))
    assert any("2 replica(s) x 2 microbatch(es) x 2 samples" in line for line in plan.rationale)


@pytest.mark.parametrize("table, refusal", [
    ({"parallel": {"timeout_s": float("inf")}}, "'timeout_s' must be <= 604800: inf"),
    ({"parallel": {"timeout_s": 1e300}}, "'timeout_s' must be <= 604800: 1e+300"),
    ({"train": {"seed": 2**63 - 1}}, "'seed' must be < 4294967296"),
    ({"train": {"betas": [1.5, 0.999]}}, "'betas' must hold numbers from 0 up to (not including) 1"),
    ({"checkpoint": {"every": 10}, "train": {"steps": 3}}, "checkpoint.every = 10 is more than train.steps = 3"),
    ({"train": {"clip_grad_norm": float("inf")}}, "'clip_grad_norm' must be a finite number, got inf"),
    ({"model": {"num_classes": 1}}, "'num_classes' must be >= 2: 1"),
    ({"train": {"optimizer": "sgd", "momentum": 5.0}}, "'momentum' must be < 1: 5.0"),
    ({"checkpoint": {"save_on_signals": ["SIGINT"]}}, "checkpoint.save_on_signals must be an array of signal names "
                                                     "from ['SIGTERM', 'SIGUSR1', 'SIGUSR2', 'SIGHUP'] (SIGINT stays"),
    ({"checkpoint": {"save_on_signals": [], "grace_s": 10}}, "checkpoint.grace_s is the time from a signal of "
                                                             "checkpoint.save_on_signals to the exit, and that list is empty"),
    ({"checkpoint": {"grace_s": float("inf")}}, "'grace_s' must be a finite number, got inf"),
], ids=["timeout-inf", "timeout-huge", "seed", "betas", "every", "clip-inf", "one-class", "momentum", "save-signal",
        "grace-unused", "grace-inf"])
def test_values_that_would_crash_or_do_nothing_later_are_refused_when_read(table, refusal):
    with pytest.raises(ConfigError) as refused:
        build_config(table)
    assert refusal in str(refused.value)


def test_a_training_set_smaller_than_a_batch_is_refused_under_steps_as_under_epochs():
    from snnfw.plan.prepare import build_datasets

    config = tiny_config("none", data={"train_samples": 4, "batch_size": 8})
    with pytest.raises(ConfigError, match=r"the training set has 4 samples, fewer than one global batch \(8\), so each "
                                          "step would repeat samples"):
        build_datasets(config, prepare(config, 1, Plugins()).spec, Plugins())


def test_a_config_file_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "latin1.toml").write_bytes("[train]\n# réglé\nsteps = 2\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text, which TOML files are; save it as UTF-8"):
        load_config(tmp_path / "latin1.toml")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "spiking_mlp"])  # spiking_mlp: an installed example
def test_a_family_plans_under_every_strategy_of_the_guarantee_matrix(family):
    """What the float64 guarantee trains under ``-m full_matrix``, planned in the default run."""
    plugins = Plugins()
    for case in CASES:
        plan = prepare(case_config(family, case, "float64"), case.ranks, plugins).plan
        assert case.strategy in (plan.strategy, plan.preset) and plan.world_size == case.ranks, case.name


def test_a_config_path_that_is_a_folder_is_refused_as_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder; pass a TOML file"):
        load_config(tmp_path)


@pytest.mark.parametrize("size, shown", [(0, "0"), (-2, "-2"), (1.5, "1.5"), ("2", '"2"'), (True, "true")])
def test_a_mesh_size_that_is_not_a_count_of_ranks_is_refused_naming_the_entry(size, shown):
    with pytest.raises(ConfigError, match=rf"^parallel.mesh.tp = {re.escape(shown)}: a dimension's size is its number "
                                          r"of ranks, a whole number 1 or more; set it like \{dp = 2, tp = 2\}$"):
        build_config({"parallel": {"mesh": {"dp": 2, "tp": size}}})


@pytest.mark.parametrize("schedule", [{"lr_schedule": "step", "step_size": 5}, {"lr_schedule": "multistep",
                                                                               "milestones": [5, 10]}])
def test_a_decay_by_gamma_above_one_is_refused(plugins, schedule):
    config = build_config({"train": {"steps": 20, "gamma": 1e6, **schedule}})
    with pytest.raises(ConfigError, match=r"train.gamma = 1000000.0 would raise the learning rate at each decay of "
                                          r"lr_schedule \"\w+\", which multiplies it by gamma to lower it; set "
                                          r"train.gamma below 1"):
        prepare(config, 1, plugins)
    prepare(build_config({"train": {"steps": 20, "gamma": 0.5, **schedule}}), 1, plugins)


def test_more_tsp_slices_than_microbatch_samples_are_refused_in_the_plan(plugins):
    config = {"parallel": {"strategy": "tsp"}, "data": {"batch_size": 8}, "model": {"time_steps": 4}}
    with pytest.raises(PlanError, match=r"tsp.slices = 64 is more than the 4 samples of a microbatch, which a neuron "
                                        r"runs in slices; set tsp.slices to 4 or fewer"):
        prepare(build_config({**config, "train": {"microbatches": 2}, "tsp": {"slices": 64}}), 2, plugins)
    assert prepare(build_config({**config, "tsp": {"slices": 8}}), 2, plugins).plan.preset == "tsp"


@pytest.mark.parametrize("setting", ["train.lr=", "train.precision=", "train.nokey", "nosection.x="])
def test_a_huge_set_value_is_not_echoed_whole(setting):
    with pytest.raises(ConfigError) as refused:
        build_config({}, [setting + "a" * 120_000 + ("=1" if setting.endswith("nokey") else "")])
    assert len(str(refused.value)) < 1000 and "characters)" in str(refused.value)


@pytest.mark.parametrize("model, said", [
    ({"blocks": ["blocks.0"]}, "model.blocks is for a model given by model.builder, and model family "
                               "'cifar10dvs_vgg' declares its own; remove it"),
    ({"blocks": ["blocks.0"], "stage_units": ["blocks.0"]}, "model.blocks, model.stage_units are for a model given "
                                                             "by model.builder"),
    ({"builder": "m:f", "flavor": "full"}, "model.flavor is for naming a registered family, and the model is given "
                                           "by model.builder or the Python API; remove it"),
    ({"builder": "m:f", "family": "x", "flavor": "full"}, "model.family, model.flavor are for naming a registered "
                                                          "family"),
])
def test_refusals_of_family_keys_read_grammatically(plugins, model, said):
    with pytest.raises(ConfigError) as refused:
        prepare(build_config({"model": model}), 1, plugins)
    assert said in str(refused.value)


DROPOUT_NET = '''
from torch import nn
from spikingjelly.activation_based import layer, neuron


def build(p=0.5):
    return nn.Sequential(layer.Flatten(step_mode="m"), nn.Dropout(p), layer.Linear(128, 64, step_mode="m"),
                         neuron.LIFNode(step_mode="m"), layer.Dropout(p, step_mode="m"),
                         layer.Linear(64, 10, step_mode="m"))


def build_without():
    return build(0.0)
'''


@pytest.mark.parametrize("strategy, world, said", [("dp", 2, "dp_replicate"), ("tsp", 2, "time"), ("pp", 2, "pp"),
                                                   ("tp", 2, None), ("none", 1, None)])
@pytest.mark.parametrize("builder", ["build", "build_without"])
def test_the_plan_says_where_dropout_makes_a_run_differ_from_none(tmp_path, strategy, world, said, builder):
    """Each rank of a data, stage or time split draws dropout masks from its own random stream (measured: dp, pp,
    tsp and fsdp2 runs of a dropout MLP differ from none's losses from step 1); tp's peers draw them as one process."""
    (tmp_path / "net.py").write_text(DROPOUT_NET)
    config = build_config({
        "model": {"builder": f"{tmp_path / 'net.py'}:{builder}", "input_shape": [2, 8, 8], "num_classes": 10,
                  "input_layout": "TN", "time_steps": 4},
        "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 32, "test_samples": 8},
        "train": {"microbatches": 2}, "parallel": {"strategy": strategy}})
    notes = [line for line in prepare(config, world, Plugins()).plan.rationale if line.startswith("dropout: ")]
    if said and builder == "build":
        assert notes == [f"dropout: 2 dropout layers (1, 4) draw their masks on each rank of {said} from its own "
                         "random stream, so the run is not none's step for step (equal in distribution); with their p "
                         "at 0 it is (the float64 guarantee)"]
    else:
        assert not notes
