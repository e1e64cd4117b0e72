"""Static images: CIFAR-100 and image folders as published, direct encoding, and the ImageNet recipe's transforms
(resized crops, RandAugment, mixup, cutmix, repeated augmentation, label smoothing of mixed targets)."""

import pickle

import pytest
import torch
import torch.nn.functional as F

from snnfw.components.losses import cross_entropy
from snnfw.config import build_config
from snnfw.data.augment import Augmented, augment_options
from snnfw.data.batches import InputSpec, global_batch_indices
from snnfw.data.images import resized_crop
from snnfw.data.randaugment import OPS, apply, rand_augment, value_at
from snnfw.errors import DataError
from snnfw.testing.layouts import write_cifar100, write_image_folder
from snnfw_plugins.datasets.images import build_cifar100, build_image_folder

SPEC = InputSpec(3, (3, 16, 16), 100)


def data(root, **keys):
    return build_config({"data": {"root": str(root), **keys}}).data


def augmented(dataset, names, seed=5, **keys):
    config = build_config({"data": {"augment": list(names), **keys}}).data
    return Augmented(dataset, config.augment, augment_options(config), seed, classes=SPEC.num_classes)


def test_cifar100_python_and_binary_versions_give_the_same_direct_encoded_images(tmp_path):
    python = build_cifar100(data(write_cifar100(tmp_path / "py", records=5)), SPEC, "train", 0)
    binary = build_cifar100(data(write_cifar100(tmp_path / "bin", records=5, version="binary")), SPEC, "train", 0)
    labels = pickle.loads((tmp_path / "py" / "train").read_bytes())[b"fine_labels"]
    assert len(python) == len(binary) == 5
    for index in range(5):
        (frames, label), (other, other_label) = python[index], binary[index]
        assert frames.shape == (3, 3, 16, 16) and torch.equal(frames, other) and label == other_label == labels[index]
        assert torch.equal(frames[0], frames[2]) and 0 <= frames.min() and frames.max() <= 1  # the image at every step


def test_a_cut_or_foreign_cifar100_file_is_refused_naming_it(tmp_path):
    root = write_cifar100(tmp_path / "bin", version="binary")
    (root / "train.bin").write_bytes((root / "train.bin").read_bytes()[:-7])
    with pytest.raises(DataError, match=r"train\.bin is not a CIFAR-100 binary batch"):
        build_cifar100(data(root), SPEC, "train", 0)
    root = write_cifar100(tmp_path / "py")
    (root / "test").write_bytes(pickle.dumps(pickle.Pickler))  # a pickle naming code, never run
    with pytest.raises(DataError, match=r"test is not a CIFAR-100 python batch \(it names _pickle.Pickler"):
        build_cifar100(data(root), SPEC, "test", 0)


def test_an_image_folder_reads_classes_in_name_order_at_the_models_size(tmp_path):
    root = write_image_folder(tmp_path)
    train, test = (build_image_folder(data(root), SPEC, split, 0) for split in ("train", "test"))
    assert len(train) == len(test) == 9
    assert [label for _, label in train.files] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # cat, dog, eel
    frames, label = test[4]
    assert frames.shape == (3, 3, 16, 16) and label == 1 and torch.equal(frames[0], frames[1])


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / "train" / "dog" / "notes.txt").write_text("x"), r"train/dog/notes\.txt is no image"),
    (lambda root: (root / "val" / "fox").mkdir(), r"class folder .*val/fox has no images"),
    (lambda root: (root / "train" / "eel" / "eel_9.png").write_bytes(b"\x89PNG cut"), None),
])
def test_a_stray_file_an_empty_class_or_an_unreadable_image_is_refused_naming_it(tmp_path, damage, message):
    root = write_image_folder(tmp_path)
    damage(root)
    if message is None:  # an image file PIL cannot read: refused when it is read
        train = build_image_folder(data(root), SPEC, "train", 0)
        with pytest.raises(DataError, match=r"eel_9\.png cannot be read as an image"):
            train[len(train) - 1]
        return
    split = "test" if "val" in message else "train"
    with pytest.raises(DataError, match=message):
        build_image_folder(data(root), SPEC, split, 0)


@pytest.mark.parametrize("split, folder", [("train", "train"), ("test", "val")])
def test_an_image_folder_of_one_class_is_refused(tmp_path, split, folder):
    root = write_image_folder(tmp_path, classes=("cat",))
    with pytest.raises(DataError, match=rf"^{tmp_path / folder} has one class folder, cat, and a classifier needs two or "
                                        r"more; add a folder of images for each other class$"):
        build_image_folder(data(root), SPEC, split, 0)


def test_mixup_targets_are_two_classes_summing_to_1_paired_by_the_sample_alone(tmp_path):
    dataset = build_cifar100(data(write_cifar100(tmp_path, records=12)), SPEC, "train", 0)
    mixed = augmented(dataset, ["mixup", "cutmix"], mix_prob=0.8)
    shares = []
    for key in range(2 * 12):  # two epochs
        frames, target = mixed[key]
        assert target.dtype == torch.float64 and target.sum() == pytest.approx(1, abs=1e-12)
        assert (target > 0).sum() <= 2 and target[dataset.labels[key % 12]] > 0
        shares.append(float(target.max()))
        assert torch.equal(frames, mixed[key][0])  # the same view and partner whenever asked
    assert any(s < 1 for s in shares) and any(s == 1 for s in shares)  # mixed at 0.8, not always


def test_cutmix_pastes_the_partners_box_and_weighs_the_target_by_its_area(tmp_path):
    dataset = build_cifar100(data(write_cifar100(tmp_path, records=8)), SPEC, "train", 0)
    plain, cut = augmented(dataset, []), augmented(dataset, ["cutmix"])
    checked = 0
    for key in range(16):
        frames, target = cut[key]
        own = (frames == plain[key][0]).all(0).all(0).double().mean()  # the share of pixels still the sample's own
        if (target > 0).sum() == 2:  # a partner of another class (noise images: its pixels differ from the sample's)
            assert float(target[dataset.labels[key % 8]]) == pytest.approx(float(own), abs=2 / 256)
            checked += 1
    assert checked >= 8


def test_randaugment_operations_keep_the_image_in_range_and_vanish_at_magnitude_0():
    image = torch.rand(1, 3, 12, 10, generator=torch.Generator().manual_seed(0))
    for op in OPS:
        out = apply(image, op, value_at(op, 30))
        assert out.shape == image.shape and 0 <= out.min() and out.max() <= 1, op
        if op not in ("autocontrast", "equalize", "posterize", "solarize", "identity"):
            assert torch.allclose(apply(image, op, value_at(op, 0)), image, atol=1e-6), op
            assert not torch.allclose(out, image, atol=1e-3), op
    generators = [torch.Generator().manual_seed(3) for _ in range(2)]
    assert torch.equal(*(rand_augment(image, 2, 9, g) for g in generators))


def test_a_resized_crop_draws_a_region_and_gives_the_models_size():
    image = torch.rand(3, 40, 30, generator=torch.Generator().manual_seed(0))
    crops = [resized_crop(image, (16, 16), (0.08, 1.0), (0.75, 4 / 3), torch.Generator().manual_seed(s)) for s in range(5)]
    assert all(c.shape == (3, 16, 16) for c in crops) and not torch.equal(crops[0], crops[1])
    square = image[:, :30, :]
    whole = resized_crop(square, (30, 30), (1.0, 1.0), (1.0, 1.0), torch.Generator().manual_seed(0))
    assert torch.equal(whole, square)  # the whole area at aspect 1: the image itself


def test_repeated_augmentation_puts_differently_keyed_copies_in_each_batch():
    keys = global_batch_indices(2, 12, 30, seed=4, keys=True, repeats=3)
    indices = keys % 30
    assert all((indices == i).sum() == 3 for i in indices.unique())  # each sample 3 times
    assert len(keys.unique()) == 12  # under 3 keys: 3 views
    assert torch.equal(global_batch_indices(2, 12, 30, seed=4, keys=True, repeats=1), global_batch_indices(2, 12, 30, 4, True))


def test_label_smoothing_of_mixed_targets_is_timms():
    logits = torch.randn(4, 5, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lam, a, b = 0.7, torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 9, 3, 2, 1])
    soft = lam * F.one_hot(a, 10).double() + (1 - lam) * F.one_hot(b, 10).double()
    smoothing, off = 0.1, 0.1 / 10
    smooth = [F.one_hot(y, 10).double() * (1 - smoothing) + off for y in (a, b)]
    timm = lam * smooth[0] + (1 - lam) * smooth[1]
    want = (-timm * logits.mean(0).log_softmax(-1)).sum(-1).mean()
    assert cross_entropy({"label_smoothing": smoothing})(logits, soft) == pytest.approx(float(want), rel=1e-12)
    hard = cross_entropy({"label_smoothing": smoothing})(logits, a)
    assert float(hard) == pytest.approx(float(cross_entropy({"label_smoothing": smoothing})(logits, F.one_hot(a, 10).double())))
