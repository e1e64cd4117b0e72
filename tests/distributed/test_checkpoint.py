"""Checkpoints: a run resumed from one equals the uninterrupted run, under the same or another strategy."""

import functools
import json
import pickle
import shutil

import attrs
import pytest
import torch

import snnfw.components.checkpoint
from snnfw.components import integrity
from snnfw.config import CheckpointConfig
from snnfw.errors import CheckpointError
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks, tiny_config
from snnfw.testing.checks import assert_close

TOL = 1e-5


def config(strategy="none", steps=6, every=3, microbatches=1, train=(), checkpoint=(), **sections):
    return tiny_config(strategy, microbatches, train={"steps": steps, **dict(train)},
                       checkpoint={"every": every, **dict(checkpoint)}, **sections)


@pytest.fixture(scope="module")
def reference():
    """Six steps of ``none`` with 2 microbatches: what 2 data-parallel ranks compute."""
    return run_training(config(microbatches=2, every=0))["losses"]


def assert_losses(expected, got, tol=TOL):
    assert len(expected) == len(got)
    for step, (want, have) in enumerate(zip(expected, got), start=1):
        assert abs(want - have) <= tol, f"step {step}: loss {have}, expected {want}"


def steps_in(run_dir):
    return [p.name for p in sorted((run_dir / "checkpoints").iterdir())]


def test_none_resumed_equals_uninterrupted_and_keeps_the_last(tmp_path, reference):
    first = run_training(config(steps=3, every=1, microbatches=2), tmp_path)
    assert first["losses"] == reference[:3]
    assert steps_in(tmp_path) == ["step-2", "step-3"]
    with pytest.raises(CheckpointError, match="pass --resume to continue it"):
        run_training(config(microbatches=2), tmp_path)
    resumed = run_training(config(every=1, microbatches=2), tmp_path, resume=True)
    assert resumed["resumed_from"] == 3 and resumed["losses"] == reference  # the whole run's
    assert steps_in(tmp_path) == ["step-5", "step-6"]
    logged = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == reference


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """A run directory with the checkpoint of one step of ``none``."""
    run_dir = tmp_path_factory.mktemp("one-step")
    run_training(config(steps=1, every=1), run_dir)
    return run_dir


def test_resuming_with_another_data_set_is_refused_naming_the_key(one_step):
    with pytest.raises(CheckpointError) as err:
        run_training(config(steps=2, every=1, data={"train_samples": 128}), one_step, resume=True)
    assert "data.train_samples is 64 in the checkpoint and 128 in the config" in str(err.value)


@pytest.mark.parametrize(
    "section, key, value, saved",
    [("data", "name", "cifar10", "'synthetic_dvs'"), ("data", "root", "elsewhere", "None"),
     ("model", "time_steps", 2, "4"), ("train", "dtype", "float64", "'float32'")],
)
def test_what_fixes_the_data_order_is_pinned(one_step, section, key, value, saved):
    base = config(steps=2, every=1)
    changed = attrs.evolve(base, **{section: attrs.evolve(getattr(base, section), **{key: value})})
    with pytest.raises(CheckpointError) as err:
        snnfw.components.checkpoint.Checkpoints(one_step, changed, rank=0).begin(trainer=None, resume=True)
    assert f"{section}.{key} is {saved} in the checkpoint and {value!r} in the config" in str(err.value)


class Killed(BaseException):
    pass


def test_a_resumed_run_keeps_its_validations_and_its_best_model(tmp_path):
    """The summary of a resumed run covers the whole run: the validations and losses before the checkpoint, and
    the best validation over all of them, whose model is the uninterrupted run's."""
    validated = {"every": 2}
    whole = run_training(config(every=0, eval=validated), tmp_path / "whole")
    run_training(config(steps=4, every=2, eval=validated), tmp_path / "cut")
    resumed = run_training(config(every=2, eval=validated), tmp_path / "cut", resume=True)
    assert [e["step"] for e in whole["evaluations"]] == [2, 4, 6]
    for key in ("evaluations", "best_eval_acc", "best_step", "losses", "test_accuracy"):
        assert resumed[key] == whole[key], key
    best = [torch.load(run / "best_model.pt", weights_only=True) for run in (tmp_path / "whole", tmp_path / "cut")]
    assert sorted(best[0]) == sorted(best[1]) and all(torch.equal(best[0][name], best[1][name]) for name in best[0])


def test_resuming_a_model_of_other_shapes_is_refused_naming_the_tensor(one_step):
    with pytest.raises(CheckpointError, match=r"holds another model: classifier.0.weight is \[10, 128\] there and "
                                              r"\[12, 128\] here; .* resume with the model settings"):
        run_training(config(steps=2, every=1, model={"num_classes": 12}), one_step, resume=True)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, reference, monkeypatch):
    save = snnfw.components.checkpoint.dcp.save

    def crash_on_step_2(state, storage_writer, **kwargs):
        if storage_writer.path.name.endswith("step-2"):
            raise Killed
        save(state, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(snnfw.components.checkpoint.dcp, "save", crash_on_step_2)
    with pytest.raises(Killed):
        run_training(config(steps=3, every=1, microbatches=2), tmp_path)
    monkeypatch.undo()
    assert steps_in(tmp_path) == [".tmp-step-2", "step-1"]
    resumed = run_training(config(steps=3, every=1, microbatches=2), tmp_path, resume=True)
    assert resumed["resumed_from"] == 1 and resumed["losses"] == reference[:3]
    assert steps_in(tmp_path) == ["step-2", "step-3"]


def test_loading_runs_no_code_from_the_checkpoint(tmp_path):
    run_training(config(steps=1, every=1), tmp_path)
    marker = tmp_path / "owned"

    class Exploit:
        def __reduce__(self):
            return (shutil.copy, (str(tmp_path / "metrics.jsonl"), str(marker)))

    folder = tmp_path / "checkpoints" / "step-1"
    (folder / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match=r"\.metadata does not match the digest"):
        run_training(config(steps=2, every=1), tmp_path, resume=True)
    meta = json.loads((folder / "meta.json").read_text())  # sealed anew, as whoever wrote .metadata could
    meta["digests"][".metadata"] = integrity.file_digest(folder / ".metadata")
    meta.pop("sealed")
    (folder / "meta.json").write_text(json.dumps({**meta, "sealed": integrity.seal_of(meta)}))
    with pytest.raises(CheckpointError, match="shutil.copy, which is not allowed"):
        run_training(config(steps=2, every=1), tmp_path, resume=True)
    assert not marker.exists()


def test_dp_two_ranks_resumed_equals_uninterrupted(tmp_path, reference64):
    """Saved with ZeRO's sharded optimizer (gathered into one whole state), resumed with a plain one."""
    assert_resumed_across(tmp_path, (config("dp", steps=3, parallel={"zero": True}, train=FLOAT64), 2),
                          (config("dp", train=FLOAT64), 2), reference64)


def test_fsdp2_checkpoint_resumes_under_tp_and_under_none(tmp_path):
    """fsdp2 (2 microbatches' worth) for 3 steps, then whole batches: tp and none from its checkpoint agree,
    and equal none saving and resuming itself."""
    saved = run_on_ranks(config("fsdp2", steps=3), 2, tmp_path / "fsdp2")
    shutil.copytree(tmp_path / "fsdp2", tmp_path / "tp")
    tp = run_on_ranks(config("tp"), 2, tmp_path / "tp", resume=True)
    none = run_training(config(), tmp_path / "fsdp2", resume=True)
    own = run_training(config(steps=3, microbatches=2), tmp_path / "none")
    own_resumed = run_training(config(), tmp_path / "none", resume=True)
    assert_losses(own["losses"], saved[0]["losses"])
    assert_losses(own_resumed["losses"], none["losses"])
    for summary in tp:
        assert_losses(none["losses"], summary["losses"])


def test_pp_checkpoint_resumes_under_pp_and_under_none(tmp_path, reference):
    """Stage state is saved under the model's names: a pipeline resumes from it, and so does one process."""
    saved = run_on_ranks(config("pp", steps=3, microbatches=2), 2, tmp_path / "pp")
    shutil.copytree(tmp_path / "pp", tmp_path / "none")
    resumed = run_on_ranks(config("pp", microbatches=2), 2, tmp_path / "pp", resume=True)
    none = run_training(config(microbatches=2), tmp_path / "none", resume=True)
    for summary in saved:
        assert_losses(reference[:3], summary["losses"])
    for summary in resumed:
        assert summary["resumed_from"] == 3
        assert_losses(reference, summary["losses"])
    assert_losses(reference, none["losses"])


def test_fsdp2_tp_checkpoint_resumes_under_none(tmp_path, reference):
    """A 2 x 2 (dp x tp) checkpoint, FSDP2 shards of tp slices, gathers into the whole model for one process."""
    saved = run_on_ranks(config("fsdp2_tp", steps=3), 4, tmp_path)
    none = run_training(config(microbatches=2), tmp_path, resume=True)
    for summary in saved:
        assert_losses(reference[:3], summary["losses"])
    assert none["resumed_from"] == 3
    assert_losses(reference, none["losses"])


@pytest.fixture(scope="module")
def memopt_cache(tmp_path_factory):
    """One memopt search cache for the module's runs, so each search runs once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_checkpoints_of_memopt_wrapped_models_resume_under_none(tmp_path, reference, monkeypatch, memopt_cache, strategy):
    """memopt wraps blocks for activation checkpointing; tp slices and pp stages are still saved under the
    model's own names, which is what any other strategy loads."""
    monkeypatch.setenv("SNNFW_CACHE_DIR", str(memopt_cache))
    memopt = {"memopt": {"level": 1}}
    saved = run_on_ranks(config(strategy, steps=3, microbatches=2, **memopt), 2, tmp_path / "run")
    none = run_training(config(microbatches=2, **memopt), tmp_path / "run", resume=True)
    for summary in saved:
        assert_losses(reference[:3], summary["losses"])
    assert none["resumed_from"] == 3
    assert_losses(reference, none["losses"])


def test_an_async_checkpoint_resumes_bit_for_bit_in_float64(tmp_path):
    """checkpoint.async_save writes in the background; a save is renamed into place at the next save and at the
    end of the run, and the run resumed from it computes the uninterrupted run's losses exactly."""
    exact = {"dtype": "float64"}
    uninterrupted = run_on_ranks(config("dp", every=0, train=exact), 2)
    first = run_on_ranks(config("dp", steps=4, every=2, train=exact, checkpoint={"every": 2, "async_save": True}), 2,
                         tmp_path)
    assert steps_in(tmp_path) == ["step-2", "step-4"]
    resumed = run_on_ranks(config("dp", every=2, train=exact, checkpoint={"every": 2, "async_save": True}), 2, tmp_path,
                           resume=True)
    for rank in range(2):
        assert first[rank]["losses"] == uninterrupted[rank]["losses"][:4]
        assert resumed[rank]["resumed_from"] == 4 and resumed[rank]["losses"] == uninterrupted[rank]["losses"]


def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(tmp_path, reference, monkeypatch):
    write = integrity.FileSystemWriter.write_data

    def crash_on_step_2(self, plan, planner):
        if self.path.name.endswith("step-2"):
            raise Killed
        return write(self, plan, planner)

    monkeypatch.setattr(integrity.FileSystemWriter, "write_data", crash_on_step_2)
    background = {"every": 1, "async_save": True}
    with pytest.raises(CheckpointError, match="background write of .*step-2 failed .*Killed.* checkpoints before it are kept"):
        run_training(config(steps=3, microbatches=2, checkpoint=background), tmp_path)
    monkeypatch.undo()
    assert steps_in(tmp_path) == [".tmp-step-2", "step-1"]
    resumed = run_training(config(steps=3, microbatches=2, checkpoint=background), tmp_path, resume=True)
    assert resumed["resumed_from"] == 1 and resumed["losses"] == reference[:3]


def _save_and_export_peaks(run_dir, trainer):
    """Peak bytes of tensors allocated while this rank saves a checkpoint and while it exports the model."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from snnfw.components.checkpoint import Checkpoints
    from snnfw.distributed.chunks import gather_whole, leaves, pieces, whole_shape

    def peak(action):
        """Peak bytes of new tensors: the model's and optimizer's own are known to the tracker, so views of
        them are not counted as new."""
        tracker = MemTracker()
        tracker.track_external(trainer.model, trainer.optimizer)
        with tracker:
            action()
        peaks = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
        return sum(peaks.get(kind, 0) for kind in (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH))

    state = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)
    tensors = [value for _, value in leaves(state) if isinstance(value, torch.Tensor) and value.dim() > 0]
    rank = torch.distributed.get_rank()
    written = Checkpoints(run_dir / "sync", trainer.config, rank)
    staged = Checkpoints(run_dir / "async", attrs.evolve(trainer.config, checkpoint=CheckpointConfig(1, async_save=True)),
                         rank)
    return {
        "whole": sum(whole_shape(t).numel() * t.element_size() for t in tensors),
        "held": sum(p.numel() * p.element_size() for t in tensors for _, p in pieces(t)),
        "largest_piece": max(p.numel() * p.element_size() for t in state["model"].values() for _, p in pieces(t)),
        "save": peak(lambda: written.save(trainer, 1, 0.0)),
        "async_save": peak(lambda: (staged.save(trainer, 1, 0.0), staged.finish())),
        "export": peak(lambda: gather_whole(state["model"], dst=0)),
    }


def test_fsdp2_saves_and_exports_hold_a_shard_not_the_whole_state(tmp_path):
    """On 4 ranks of the full VGG a save allocates a sliver, a save staged to CPU for a background write at most
    the rank's quarter of the state and 10 %, and an export on ranks 1 to 3 one piece at a time (the whole model is
    gathered on rank 0 only); gathering the whole state allocated all of it on every rank."""
    summaries = run_on_ranks(config("fsdp2", steps=1, every=0, model={"flavor": "full"}), 4,
                             inspect=functools.partial(_save_and_export_peaks, tmp_path),
                             timeout_s=300)
    for rank, summary in enumerate(summaries):
        peaks = summary["inspect"]
        assert peaks["held"] <= 1.1 * peaks["whole"] / 4, peaks
        assert peaks["save"] <= 0.01 * peaks["whole"], (rank, peaks)
        assert peaks["async_save"] <= 1.1 * peaks["whole"] / 4, (rank, peaks)
        if rank:
            assert peaks["export"] <= 1.1 * peaks["largest_piece"], (rank, peaks)


FLOAT64 = {"dtype": "float64"}  # where rounding cannot hide a wrong resume: every step within 1e-9 relative


def mesh(sizes: dict, **kwargs):
    return config("mesh", parallel={"mesh": sizes}, train=FLOAT64, **kwargs)


@pytest.fixture(scope="module")
def reference64():
    """:func:`reference` in float64."""
    return run_training(config(microbatches=2, every=0, train=FLOAT64))["losses"]


def assert_resumed_across(tmp_path, saved: tuple, resumed: tuple, want: list[float]) -> None:
    """``saved`` = (config, ranks) trains 3 steps and checkpoints; ``resumed`` = (config, ranks) goes on from there:
    the uninterrupted run's float64 losses ``want``, each within 1e-9 relative."""
    first = run_on_ranks(*saved, tmp_path, timeout_s=600)
    then = run_on_ranks(*resumed, tmp_path, resume=True)
    for rank, summary in enumerate(first):
        assert len(summary["losses"]) == 3
        for step, (have, expected) in enumerate(zip(summary["losses"], want[:3]), start=1):
            assert_close(f"rank {rank} step {step} loss before the checkpoint", have, expected)
    for rank, summary in enumerate(then):
        assert summary["resumed_from"] == 3 and len(summary["losses"]) == len(want)
        for step, (have, expected) in enumerate(zip(summary["losses"], want), start=1):
            assert_close(f"rank {rank} step {step} loss on the other mesh", have, expected)


def test_a_composed_checkpoint_resumes_on_another_composed_mesh(tmp_path, reference64):
    """dp_shard x tp (FSDP2 shards of tp slices) saved, resumed on dp_replicate x time (whole replicas, time split):
    the uninterrupted run's losses."""
    assert_resumed_across(tmp_path, (mesh({"dp_shard": 2, "tp": 2}, steps=3), 4),
                          (mesh({"dp_replicate": 2, "time": 2}), 4), reference64)


def test_a_mesh_of_replicas_with_zero_resumes_on_a_sharded_mesh(tmp_path, reference64):
    """dp_replicate x time with ZeRO's optimizer (each rank's partition under the parameters' names) saved, resumed
    on dp_shard x tp: the uninterrupted run's losses."""
    saved = config("mesh", parallel={"mesh": {"dp_replicate": 2, "time": 2}, "zero": True}, train=FLOAT64, steps=3)
    assert_resumed_across(tmp_path, (saved, 4), (mesh({"dp_shard": 2, "tp": 2}), 4), reference64)


def test_a_pipelined_mesh_checkpoint_resumes_on_a_sharded_one(tmp_path):
    """pp x dp_replicate (stage state under the model's names) saved, resumed on dp_shard x tp with as many
    microbatches: none's losses with 4."""
    want = run_training(config(microbatches=4, every=0, train=FLOAT64))["losses"]
    assert_resumed_across(tmp_path, (mesh({"pp": 2, "dp_replicate": 2}, steps=3, microbatches=2), 4),
                          (mesh({"dp_shard": 2, "tp": 2}, microbatches=2), 4), want)


@pytest.mark.full_matrix
def test_a_three_dimensional_checkpoint_resumes_on_two_dimensions(tmp_path, reference64):
    """dp_shard x time x tp on 8 ranks saved, resumed on dp_shard x tp."""
    assert_resumed_across(tmp_path, (mesh({"dp_shard": 2, "time": 2, "tp": 2}, steps=3), 8),
                          (mesh({"dp_shard": 2, "tp": 2}), 4), reference64)