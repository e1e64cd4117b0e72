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
