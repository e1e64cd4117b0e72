"""The torchrun example trainers in examples/, each on 2 ranks on tiny data in its data set's on-disk layout."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snnfw.config import build_config
from snnfw.plan.prepare import build_model
from snnfw.plugin.manager import Plugins
from snnfw.testing.layouts import cifar10_dvs_layout, write_cifar10
from snnfw.testing.raw_events import write_cifar10_dvs

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def torchrun(script: str, *args: str) -> list[str]:
    """Runs ``examples/script`` on 2 ranks; the lines it printed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "examples" / script), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def assert_trained_model(path: Path, model: dict) -> None:
    """``path`` loads strictly into the family's module and differs from its initial weights."""
    net = build_model(build_config({"model": model}), Plugins())[0]
    initial = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    net.load_state_dict(torch.load(path, weights_only=True), strict=True)
    changed = [name for name, tensor in net.state_dict().items() if not torch.equal(tensor, initial[name])]
    assert changed, f"{path} holds the initial weights"


def raw_cifar10_dvs(root: Path) -> Path:
    write_cifar10_dvs(root, per_class=30, classes=2)
    return root


@pytest.mark.parametrize("layout", [cifar10_dvs_layout, raw_cifar10_dvs], ids=["frames", "raw"])
def test_the_dvs_trainer_validates_every_epoch_and_keeps_checkpoints_and_models(tmp_path, layout):
    """The TET recipe at the VGG's tiny flavor on CIFAR10-DVS (2 classes of 30 samples: 54 to train, 6 to test),
    from SpikingJelly's frames folder or from the raw recordings, batch 8: 6 steps an epoch."""
    root, run_dir = layout(tmp_path / "cifar10dvs"), tmp_path / "run"
    lines = torchrun("train_dvs.py", "--recipe", "cifar10dvs_vgg_tet", "--root", str(root), "--strategy", "dp",
                     "--set", "model.flavor=tiny", "--set", "model.time_steps=4", "--set", "train.epochs=2",
                     "--set", "data.batch_size=8", "--run-dir", str(run_dir))
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"], lines  # rank 0 alone prints
    accuracies = [float(re.search(r"test acc ([\d.]+)%", line).group(1)) for line in epochs]
    assert lines[-1] == f"dp on 2 rank(s): best test accuracy {max(accuracies):.1f}%"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-12", "step-6"]
    for name in ("best_model.pt", "final_model.pt"):
        assert_trained_model(run_dir / name, {"family": "cifar10dvs_vgg", "flavor": "tiny"})


def test_the_spikformer_trainer_trains_spikformer_4_384_on_cifar10_batches(tmp_path):
    """The recipe on CIFAR-10's binary batches of 4 images each (20 to train, 4 to test), batch 4: 5 steps,
    validated once."""
    root, run_dir = write_cifar10(tmp_path / "cifar-10-batches-bin"), tmp_path / "run"
    lines = torchrun("train_spikformer_cifar10.py", "--root", str(root), "--strategy", "fsdp2",
                     "--set", "model.time_steps=2", "--set", "train.epochs=1", "--set", "eval.every_epochs=1",
                     "--set", "data.batch_size=4", "--set", "train.warmup_epochs=0", "--run-dir", str(run_dir))
    assert len(lines) == 2 and lines[0].startswith("step 5, epoch 1: loss "), lines
    assert re.fullmatch(r"fsdp2 on 2 rank\(s\): best test accuracy [\d.]+% at step \d", lines[1]), lines
    assert_trained_model(run_dir / "final_model.pt", {"family": "spikformer", "flavor": "cifar10"})
