"""Raw recordings to a trained model on two ranks: events a model can learn, integrated by tonic and cached once for
both ranks, beat chance clearly: N-MNIST under dp and fsdp2, SHD on the sequence family under tsp."""

import pytest

from snnfw.config import build_config
from snnfw.testing import run_on_ranks
from snnfw.testing.raw_events import write_nmnist

CLASSES = 4  # of N-MNIST's ten digits, written; chance is 1 in 4


@pytest.mark.parametrize("strategy", ["dp", "fsdp2"])
def test_raw_recordings_train_a_model_that_beats_chance(tmp_path, strategy):
    write_nmnist(tmp_path / "raw", per_class=12, classes=CLASSES)
    config = build_config({
        "model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4},
        "data": {"name": "n_mnist", "root": str(tmp_path / "raw"), "batch_size": 8, "frames": {"by": "time"}},
        "train": {"steps": 30, "lr": 0.01, "seed": 3},
        "parallel": {"strategy": strategy, "device": "cpu"},
    })
    summaries = run_on_ranks(config, 2, tmp_path / "run", timeout_s=300)
    assert summaries[0]["test_accuracy"] >= 0.6, summaries[0]["test_accuracy"]
    caches = [p for p in (tmp_path / "raw" / ".snnfw-frames").iterdir() if not p.name.startswith(".")]
    assert sorted(p.name.split("-")[1] for p in caches) == ["test", "train"]  # one per split, made once


def test_raw_shd_trains_the_sequence_family_with_its_time_steps_split_across_ranks(tmp_path):
    from snnfw.testing.raw_events import write_shd

    write_shd(tmp_path / "raw", per_class=12, classes=CLASSES)
    config = build_config({
        "model": {"family": "sequence_mlp", "flavor": "shd", "time_steps": 8, "num_classes": CLASSES},
        "data": {"name": "shd", "root": str(tmp_path / "raw"), "batch_size": 8, "frames": {"by": "time"}},
        "train": {"steps": 30, "lr": 0.003, "seed": 3},
        "parallel": {"strategy": "tsp", "device": "cpu"},
    })
    summaries = run_on_ranks(config, 2, tmp_path / "run", timeout_s=300)
    assert summaries[0]["plan"]["preset"] == "tsp" and summaries[0]["plan"]["mesh"] == {"time": 2}
    assert summaries[0]["test_accuracy"] >= 0.6, summaries[0]["test_accuracy"]


@pytest.mark.parametrize("name", ["n_caltech101", "asl_dvs", "dvs_lip"])
def test_the_publishers_files_of_more_event_sets_train_from_frames_cached_once(tmp_path, name):
    """N-Caltech101's ATIS binaries, ASL-DVS's MATLAB files and DVS-Lip's NumPy arrays, integrated by tonic into the
    cache and trained on (one process: the cache's sharing between ranks is N-MNIST's test above)."""
    from snnfw.run.loop import run_training
    from snnfw.testing import raw_events

    writer = {"n_caltech101": raw_events.write_ncaltech101, "asl_dvs": raw_events.write_asl_dvs,
              "dvs_lip": raw_events.write_dvs_lip}[name]
    writer(tmp_path / "raw", classes=CLASSES)
    config = build_config({
        "model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4},
        "data": {"name": name, "root": str(tmp_path / "raw"), "batch_size": 8},
        "train": {"steps": 3, "lr": 0.01, "seed": 3},
    })
    summary = run_training(config)
    assert len(summary["losses"]) == 3 and all(0 < loss < 10 for loss in summary["losses"])
    caches = [p for p in (tmp_path / "raw" / ".snnfw-frames").iterdir() if not p.name.startswith(".")]
    assert sorted(p.name.split("-")[1] for p in caches) == ["test", "train"]
    assert 0 <= summary["test_accuracy"] <= 1  # scored over the cached test split
