"""The cost model: predictions that follow bytes and links, corrections learned from records, records refused."""

import json

import attrs
import pytest

from snnfw.errors import UserError
from snnfw.plan import cost_model
from snnfw.plan.cost_model import Cluster, Corrections, StepTerms, Traffic


def terms(strategy="dp", compute=10.0, nbytes=0.0, calls=1, bubble=0.0):
    traffic = (Traffic("all_reduce", nbytes, calls),) if nbytes else ()
    return StepTerms(strategy, compute, 1.0, bubble, 1, traffic, ())


def cluster(local_ranks=2, cores=2):
    return Cluster.assumed("cpu", "cpu", cores, local_ranks)


def test_more_bytes_over_the_same_bandwidth_take_longer_by_their_transfer_time():
    here = cluster()
    few, many = cost_model.predict(terms(nbytes=1e6), here), cost_model.predict(terms(nbytes=5e6), here)
    bandwidth = here.links["all_reduce"].bandwidth.value
    assert many.ms > few.ms
    assert many.ms - few.ms == pytest.approx(4e6 / bandwidth * 1e3)


def test_a_bubble_and_oversubscribed_cores_stretch_compute():
    alone = cost_model.predict(terms(), cluster(local_ranks=2, cores=2))
    bubbled = cost_model.predict(terms(bubble=0.5), cluster(local_ranks=2, cores=2))
    crowded = cost_model.predict(terms(), cluster(local_ranks=4, cores=2))
    assert bubbled.compute_ms == pytest.approx(21.0) and alone.compute_ms == pytest.approx(11.0)
    assert crowded.compute_ms == pytest.approx(2 * alone.compute_ms)


def test_every_figure_says_where_it_came_from():
    lines = cost_model.predict(terms(nbytes=1e6), cluster()).lines
    assert any("assumed for cpu (no probe)" in line for line in lines)
    assert any("not learned (no records)" in line for line in lines)


def record(strategy, compute, communication, measured, mesh=None):
    return {"device": "cpu", "nproc": 2, "plan": {"strategy": strategy, "mesh": mesh or {"dp": 2}}, "step_ms": measured,
            "predicted": {"ms": compute + communication, "compute_ms": compute, "communication_ms": communication}}


def test_fit_recovers_a_planted_overhead_and_factors_and_a_layout_s_own_factor():
    planted = [(c, m, 5.0 + 2.0 * c + 3.0 * m) for c, m in ((10, 1), (20, 4), (5, 9), (40, 2))]
    records = [record("mesh", c, m, t, {"dp_replicate": 2}) for c, m, t in planted[:1]] + \
        [record("mesh", c, m, t, {"dp_shard": 2}) for c, m, t in planted[1:]]
    fitted = cost_model.fit(records, "cpu")
    assert (fitted.overhead_ms, fitted.compute, fitted.communication) == pytest.approx((5.0, 2.0, 3.0))
    assert fitted.apply(30, 5, "echo") == pytest.approx(5.0 + 2.0 * 30 + 3.0 * 5)  # no records: the shared terms
    assert fitted.strategies == pytest.approx({"mesh": (28 / 11 + 57 / 24) / 2,  # the median of all four
                                               "mesh (dp_shard)": 57 / 24})  # the median of 57/24, 42/14, 91/42
    slower = records + [record("mesh", 10, 0, 30.0, {"tp": 2}), record("mesh", 20, 0, 60.0, {"tp": 2})]
    assert cost_model.fit(slower, "cpu").apply(40, 0, "mesh", ("tp",)) == pytest.approx(120.0)  # tp ran 3x its terms


def test_a_layout_s_factor_is_learned_apart_for_each_mesh_with_records_whichever_way_they_were_spelled():
    """A pipeline alone ran 1.3 times its terms and a pipeline over data replicas 0.8 (records written by 0.2.0,
    whose strategy pp named the replicas dp): each layout takes its own factor, and a layout without records the
    composition's over all of them."""
    alone = [record("pp", 10, 0, 13.0, {"pp": 2}), record("mesh", 20, 0, 26.0, {"pp": 2})]
    replicas = [record("pp", 10, 0, 8.0, {"pp": 2, "dp": 2}), record("mesh", 20, 0, 16.0, {"pp": 2, "dp_replicate": 2})]
    fitted = cost_model.fit(alone + replicas, "cpu")
    assert fitted.apply(100, 0, "mesh", ("pp",)) == pytest.approx(130.0)
    assert fitted.apply(100, 0, "mesh", ("pp", "dp_replicate")) == pytest.approx(80.0)
    assert fitted.apply(100, 0, "mesh", ("pp", "tp")) == pytest.approx(105.0)  # the median of 1.3, 1.3, 0.8, 0.8
    assert cost_model.predict(terms("mesh", compute=100.0), cluster(local_ranks=1), fitted).ms == pytest.approx(
        1.05 * 101.0)  # terms without a mesh: the composition's factor, on compute and the optimizer's 1 ms


def test_fit_needs_three_records_and_keeps_other_devices_apart():
    two = [record("dp", 10, 1, 30), record("dp", 20, 2, 50)]
    assert cost_model.fit(two, "cpu") == Corrections("cpu")
    assert cost_model.fit([dict(r, device="NVIDIA H100") for r in two * 2], "cpu") == Corrections("cpu")


def test_a_damaged_or_foreign_records_file_is_refused_in_one_line(tmp_path):
    damaged = tmp_path / "bench.jsonl"
    damaged.write_text(json.dumps(record("dp", 1, 1, 2)) + "\n{not json\n")
    with pytest.raises(UserError, match=r"line 2 is not a JSON record") as err:
        cost_model.read_records(damaged)
    assert "\n" not in str(err.value)
    foreign = tmp_path / "other.jsonl"
    foreign.write_text(json.dumps({"loss": 1.0, "step": 3}) + "\n")
    with pytest.raises(UserError, match=r"line 1 is not an snnfw bench record") as err:
        cost_model.read_records(foreign)
    assert "\n" not in str(err.value)


def test_corrections_are_stored_per_device_and_a_damaged_file_refused(tmp_path):
    path = tmp_path / "corrections.json"
    learned = Corrections("cpu", 4, 1.0, 2.0, 3.0, {"dp": 1.1})
    cost_model.write_corrections(path, learned)
    cost_model.write_corrections(path, Corrections("NVIDIA H100", 3))
    assert cost_model.read_corrections(path, "cpu") == learned
    assert cost_model.read_corrections(path, "other") == Corrections("other")
    path.write_text("[1, 2")
    with pytest.raises(UserError, match="not snnfw's corrections file"):
        cost_model.read_corrections(path, "cpu")


def tiny_file(tmp_path):
    from snnfw.testing import TINY

    path = tmp_path / "tiny.toml"
    path.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
                            for section, values in TINY.items()))
    return path


def test_tune_tries_the_settings_the_plugins_offer_for_the_keys_the_user_did_not_set(tmp_path):
    """Precision (an autocast of float32), the neuron backends that run here and memopt's checkpointing, each
    alone and together, fewest changes first; a key the user set is not varied."""
    from snnfw.config import load_config
    from snnfw.plan.prepare import tune_settings
    from snnfw.plugin.manager import Plugins
    from snnfw.tools import tune

    path, plugins = tiny_file(tmp_path), Plugins()
    offered = tune_settings(load_config(path, ["parallel.strategy=auto"]), 2, plugins)
    assert offered == {"train.precision": ("bf16",), "model.neuron_backend": ("inductor",), "memopt.level": (1,)}
    set_by_user = ["parallel.strategy=auto", "train.precision=fp32", "model.neuron_backend=torch"]
    assert tune_settings(load_config(path, set_by_user), 2, plugins) == {"memopt.level": (1,)}
    combined = tune.combinations(offered)
    assert len(combined) == 7 and [len(c) for c in combined] == [1, 1, 1, 2, 2, 2, 3]
    assert set(combined[-1]) == {("train.precision", "bf16"), ("model.neuron_backend", "inductor"), ("memopt.level", 1)}


def test_a_setting_s_candidates_take_its_profile_and_the_dry_run_s_collectives_and_memory_less_what_it_saves(tmp_path):
    """bf16's profile saves half the activation bytes of fp32's; its candidates are the dry-run ones, their
    collectives the dry run's, their compute that profile's, their memory the dry run's less what the estimates
    under bf16 hold less."""
    from snnfw.config import load_config
    from snnfw.plan.cost_model import terms_of
    from snnfw.plan.prepare import costed_candidates
    from snnfw.plugin.manager import Plugins
    from snnfw.tools import tune

    path, base, plugins = tiny_file(tmp_path), ["parallel.strategy=auto"], Plugins()
    ranked, _, fp32 = costed_candidates(load_config(path, base), 2, plugins, threads=1)
    planted = Traffic("all_reduce", 1e6, 3)
    dry_run = [tune.Tuned(tune._name(c), tuple(c.overrides()), attrs.evolve(terms_of(c.strategy, c.estimate, fp32),
                                                                             traffic=(planted,)),
                          10**9, c.estimate.memory_bytes) for c in ranked[:2]]
    again = tune._in_setting(path, base, 2, plugins, dry_run, (("train.precision", "bf16"),))
    assert [t.overrides for t in again] == [(*t.overrides, "train.precision=bf16") for t in dry_run]
    assert all(t.terms.traffic == (planted,) for t in again)
    assert all(10**9 - t.memory_bytes == round(d.estimate_bytes - t.estimate_bytes) > 0 for t, d in zip(again, dry_run))
    bf16 = costed_candidates(load_config(path, [*base, "train.precision=bf16"]), 2, plugins, threads=1)[2]
    assert bf16.activation_bytes == pytest.approx(fp32.activation_bytes / 2, rel=0.15)


def test_the_profile_times_the_model_as_the_run_transforms_it(tmp_path):
    """memopt.level 1 checkpoints the blocks: its profile saves a fraction of the activations and recomputes
    the forward in backward (the bare model's profile would hold them all)."""
    from snnfw.config import load_config
    from snnfw.plan.prepare import costed_candidates
    from snnfw.plugin.manager import Plugins

    path, plugins = tiny_file(tmp_path), Plugins()
    plain = costed_candidates(load_config(path, ["parallel.strategy=auto"]), 2, plugins, threads=1)[2]
    checkpointed = costed_candidates(load_config(path, ["parallel.strategy=auto", "memopt.level=1"]), 2, plugins,
                                     threads=1)[2]
    assert checkpointed.activation_bytes < plain.activation_bytes / 2
