"""The published recipes in examples/recipes: each plans on its data set's on-disk layout, epochs resolved; the event
recipes on their publishers' raw recordings too; the language model's on its embedded corpus, under the overrides its
comment gives."""

from pathlib import Path

import pytest

from snnfw.config import load_config
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing.layouts import cifar10_dvs_layout, split_layout, write_cifar10, write_cifar100, write_image_folder
from snnfw.testing.raw_events import write_cifar10_dvs, write_dvs128_gesture, write_nmnist, write_shd

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.toml"))
RAW = {"cifar10_dvs": write_cifar10_dvs, "dvs128_gesture": write_dvs128_gesture, "n_mnist": write_nmnist}
ON_DISK = [p for p in RECIPES if load_config(p).data.name != "python_bytes"]


def layout(name: str, root: Path, time_steps: int) -> tuple[Path, int]:
    """Tiny files in the layout the recipe's data set reads (small frames: only their count and first shape
    matter here); the folder and its number of training samples."""
    if name == "cifar10":
        return write_cifar10(root, records=13), 65
    if name == "cifar100":
        return write_cifar100(root, records=20), 20
    if name == "image_folder":
        return write_image_folder(root, classes=[f"n{i:08d}" for i in range(4)], per_class=3), 12
    if name == "shd":
        write_shd(root, per_class=2, classes=20, events=50)
        return root, 40
    if name == "cifar10_dvs":
        return cifar10_dvs_layout(root, samples=40, time_steps=time_steps, side=8), 72  # 36 a class to train
    classes = [str(c) for c in range(11 if name == "dvs128_gesture" else 10)]
    return split_layout(root, classes, per_class=2, time_steps=time_steps, side=8), 2 * len(classes)


def test_every_recipe_is_here():
    assert [p.stem for p in RECIPES] == ["cifar10dvs_vgg_tet", "dvs128_gesture", "n_mnist_plif", "shd_sequence_mlp",
                                         "spikformer_cifar10", "spikformer_cifar100", "spikformer_imagenet", "spiking_lm"]


def test_the_language_model_recipe_plans_as_written_and_at_the_tiny_shape_on_a_mesh():
    recipe = ROOT / "examples" / "recipes" / "spiking_lm.toml"
    plan = prepare(load_config(recipe), 2, Plugins()).plan
    assert (plan.name, plan.config.train.loss, plan.config.model.sequence_length) == ("dp", "next_token", 64)
    tiny = load_config(recipe, ['model.flavor="tiny"', 'train.dtype="float64"', 'parallel.strategy="mesh"',
                                "parallel.mesh={tp=2}", "model.sequence_length=16"])
    plan = prepare(tiny, 2, Plugins()).plan
    assert dict(plan.mesh) == {"tp": 2} and plan.config.train.dtype == "float64"


@pytest.mark.parametrize("recipe", ON_DISK, ids=lambda p: p.stem)
def test_a_recipe_plans_on_its_data_set_with_its_epochs(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # model.builder paths start at the repository root
    written = load_config(recipe)
    root, samples = layout(written.data.name, tmp_path, written.model.time_steps)
    batch = min(written.data.batch_size, samples)
    config = load_config(recipe, [f"data.root={root}", f"data.batch_size={batch}"])
    plan = prepare(config, 2, Plugins()).plan
    per_epoch = samples // batch
    assert plan.config.train.steps == written.train.epochs * per_epoch
    assert plan.config.eval.every == written.eval.every_epochs * per_epoch
    assert (plan.preset or plan.strategy) == written.parallel.strategy
    assert plan.config.train.warmup_steps == written.train.warmup_epochs * per_epoch


@pytest.mark.parametrize("recipe", [p for p in RECIPES if load_config(p).data.name in RAW], ids=lambda p: p.stem)
def test_an_event_recipe_plans_on_the_raw_recordings_as_published(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    written = load_config(recipe)
    samples = len(RAW[written.data.name](tmp_path)["train"])
    batch = min(written.data.batch_size, samples)
    config = load_config(recipe, [f"data.root={tmp_path}", f"data.batch_size={batch}"])
    plan = prepare(config, 2, Plugins()).plan
    assert plan.config.train.steps == written.train.epochs * (samples // batch)
    assert (plan.preset or plan.strategy) == written.parallel.strategy
    cached = sorted(p.name.split("-")[1] for p in (tmp_path / ".snnfw-frames").iterdir() if p.is_dir())
    assert cached == ["test", "train"]  # integrated by tonic once, beside the data
