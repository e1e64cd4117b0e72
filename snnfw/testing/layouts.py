"""Tiny files in each on-disk data set's layout (SpikingJelly's frame folders, CIFAR-10's binary batches)."""

import numpy as np


def write_frames(folder, names, shape=(4, 2, 40, 40), seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in names:
        np.savez(folder / f"{name}.npz", frames=rng.poisson(0.3, shape).astype(np.float32))


def split_layout(root, classes=("0", "1", "10"), per_class=2, time_steps=4, side=40):
    """DVS128 Gesture's and N-MNIST's layout: frames_number_T_split_by_number/{train,test}/<class>/*.npz."""
    frames = root / f"frames_number_{time_steps}_split_by_number"
    for split in ("train", "test"):
        for c in classes:
            write_frames(frames / split / c, [f"user{i}" for i in range(per_class)], shape=(time_steps, 2, side, side))
    return root


def cifar10_dvs_layout(root, samples=30, time_steps=4, side=40):
    """CIFAR10-DVS as SpikingJelly integrates it, unsplit: frames_number_T_split_by_number/<class>/*.npz."""
    for c in ("airplane", "automobile"):
        write_frames(root / f"frames_number_{time_steps}_split_by_number" / c, [f"cifar10_{c}_{i}" for i in range(samples)],
                     shape=(time_steps, 2, side, side))
    return root


def write_cifar10(root, records=4):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]):
        batch = np.concatenate([rng.integers(0, 10, (records, 1)), rng.integers(0, 256, (records, 3072))], axis=1)
        batch[0, 1:] = 255 * (i % 2)  # one white or black image per batch
        batch.astype(np.uint8).tofile(root / name)
    return root


def write_cifar100(root, records=4, version="python"):
    """CIFAR-100 as published: the python version's pickles ``train`` and ``test`` (a dict of ``data``,
    ``fine_labels``, ``coarse_labels`` under byte keys) or the binary version's ``train.bin`` and ``test.bin``."""
    import pickle

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        pixels = rng.integers(0, 256, (records, 3072), dtype=np.uint8)
        fine, coarse = rng.integers(0, 100, records), rng.integers(0, 20, records)
        if version == "binary":
            np.concatenate([coarse[:, None], fine[:, None], pixels], axis=1).astype(np.uint8).tofile(root / f"{split}.bin")
        else:
            batch = {b"filenames": [b"x.png"] * records, b"fine_labels": fine.tolist(), b"coarse_labels": coarse.tolist(),
                     b"data": pixels}
            (root / split).write_bytes(pickle.dumps(batch))
    return root


def write_image_folder(root, classes=("cat", "dog", "eel"), per_class=3, sizes=((20, 24), (18, 18), (30, 16))):
    """ImageNet's layout, ``train/<class>/*.png`` and ``val/<class>/*.jpg``, images of varied sizes."""
    from PIL import Image

    rng = np.random.default_rng(2)
    for split, extension in (("train", "png"), ("val", "jpg")):
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                height, width = sizes[i % len(sizes)]
                pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{c}_{i}.{extension}")
    return root
