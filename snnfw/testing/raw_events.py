"""Tiny data sets written in their publishers' raw formats, with events a model can learn: each class fires in a
band of its own (N-MNIST and CIFAR10-DVS: a band of rows; SHD: a band of channels).

Each writer returns what it wrote: ``{split: [(events, label), ...]}`` in the order the data set lists its
samples, the events as tonic's structured arrays (fields x, y, t, p; SHD's t, x, p)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tonic.io import make_structured_array

XYTP = np.dtype([("x", int), ("y", int), ("t", int), ("p", int)])
TXP = np.dtype([("t", int), ("x", int), ("p", int)])
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def class_events(label: int, classes: int, size: int, count: int, rng: np.random.Generator):
    """``count`` events ``(x, y, t_us, p)`` whose rows (y) lie in class ``label``'s band of ``size`` rows."""
    band = size // classes
    x = rng.integers(0, size, count)
    y = rng.integers(label * band, (label + 1) * band, count)
    t = np.sort(rng.integers(0, 300_000, count))
    p = rng.integers(0, 2, count)
    return x, y, t, p


def atis_bytes(x, y, t, p) -> bytes:
    """Events in N-MNIST's 40-bit format (N-Caltech101's too): x, y, then polarity and 23 bits of time."""
    return np.stack([x, y, (p << 7) | (t >> 16 & 127), t >> 8 & 255, t & 255], axis=1).astype(np.uint8).tobytes()


def write_nmnist(root: Path, per_class: int = 4, classes: int = 4, events: int = 400, seed: int = 0) -> dict:
    """``root/Train/<digit>/*.bin`` and ``root/Test/...`` in N-MNIST's 40-bit event format."""
    rng = np.random.default_rng(seed)
    written = {"train": [], "test": []}
    for split in ("Train", "Test"):
        for digit in range(classes):
            folder = root / split / str(digit)
            folder.mkdir(parents=True, exist_ok=True)
            for sample in range(per_class):
                x, y, t, p = class_events(digit, classes, 34, events, rng)
                (folder / f"{sample:05d}.bin").write_bytes(atis_bytes(x, y, t, p))
                written[split.lower()].append((make_structured_array(x, y, t, p, dtype=XYTP), digit))
    return written


def write_cifar10_dvs(root: Path, per_class: int = 10, classes: int = 4, events: int = 600, seed: int = 0) -> dict:
    """``root/<class>/cifar10_<class>_<n>.aedat`` in AEDAT 2.0, addresses as CIFAR10-DVS's camera wrote them; the
    first tenth of each class's samples are the test split."""
    rng = np.random.default_rng(seed)
    written = {"train": [], "test": []}
    for label in range(classes):
        folder = root / CIFAR10_CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        for sample in range(per_class):
            x, y, t, p = class_events(label, classes, 128, events, rng)
            raw_x, raw_y, raw_p = 127 - y, 127 - x, 1 - p  # what SpikingJelly's decoding mirrors back
            address = (raw_x << 1) | (raw_y << 8) | raw_p
            body = np.stack([address, t], axis=1).astype(">u4").tobytes()
            header = b"#!AER-DAT2.0\r\n# This is a raw AE data file written for a test\r\n"
            (folder / f"cifar10_{CIFAR10_CLASSES[label]}_{sample}.aedat").write_bytes(header + body)
            split = "test" if sample < per_class // 10 else "train"
            written[split].append((make_structured_array(x, y, t, p, dtype=XYTP), label))
    return {split: sorted(samples, key=lambda sample: sample[1]) for split, samples in written.items()}


def write_shd(root: Path, per_class: int = 4, classes: int = 4, events: int = 300, seed: int = 0,
              prefix: str = "shd") -> dict:
    """``root/shd_train.h5`` and ``root/shd_test.h5`` as the publisher ships them (times in seconds); SSC's
    ``ssc_*.h5`` with ``prefix = "ssc"``."""
    import h5py

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    written = {"train": [], "test": []}
    for split in ("train", "test"):
        labels = [label for label in range(classes) for _ in range(per_class)]
        with h5py.File(root / f"{prefix}_{split}.h5", "w") as file:
            times = file.create_dataset("spikes/times", (len(labels),), dtype=h5py.vlen_dtype(np.float32))
            units = file.create_dataset("spikes/units", (len(labels),), dtype=h5py.vlen_dtype(np.uint16))
            for index, label in enumerate(labels):
                _, channel, t, _ = class_events(label, classes, 700, events, rng)
                seconds = (t / 1e6).astype(np.float32)
                times[index], units[index] = seconds, channel.astype(np.uint16)
                t_us = (seconds.astype(np.float64) * 1e6).astype(int)  # as a reader in microseconds gets them
                written[split].append((make_structured_array(t_us, channel, 1, dtype=TXP), label))
            file.create_dataset("labels", data=np.array(labels, dtype=np.uint16))
    return written


def write_dvs128_gesture(root: Path, per_class: int = 2, classes: int = 4, events: int = 500, seed: int = 0) -> dict:
    """``root/DvsGesture/``: ``per_class`` AEDAT 3.1 trials per split (a special-event packet, then polarity packets) holding one gesture of
    each class with unlabelled events between them, their ``_labels.csv`` and the ``trials_to_*.txt`` lists."""
    import struct

    rng = np.random.default_rng(seed)
    folder = root / "DvsGesture"
    folder.mkdir(parents=True, exist_ok=True)
    written = {"train": [], "test": []}
    for split, first_user in (("train", 1), ("test", 21)):
        names = [f"user{first_user + n:02d}_led.aedat" for n in range(per_class)]
        for name in names:
            packets, rows, clock = [struct.pack("<HHIIIIII", 0, 1, 8, 4, 0, 1, 1, 1) + bytes(8)], [], 1000
            for label in rng.permutation(classes):
                x, y, t, p = class_events(label, classes, 128, events, rng)
                gap_x, gap_y, gap_t, gap_p = class_events(0, 1, 128, 50, rng)  # between gestures, unlabelled
                start = clock + 400_000
                for xs, ys, ts, ps in ((gap_x, gap_y, clock + gap_t // 2, gap_p), (x, y, start + t, p)):
                    words = np.stack([xs << 17 | ys << 2 | ps << 1 | 1, ts], axis=1).astype("<u4")
                    packets.append(struct.pack("<HHIIIIII", 1, 1, 8, 4, 0, len(ts), len(ts), len(ts)) + words.tobytes())
                rows.append(f"{label + 1},{start},{start + 300_000}")
                written[split].append((make_structured_array(x, y, start + t, p, dtype=XYTP), int(label)))
                clock = start + 300_000
            header = b"#!AER-DAT3.1\r\n#Format: RAW\r\n#!END-HEADER\r\n"
            (folder / name).write_bytes(header + b"".join(packets))
            (folder / name.replace(".aedat", "_labels.csv")).write_text(
                "class,startTime_usec,endTime_usec\n" + "\n".join(rows) + "\n")
        (folder / f"trials_to_{split}.txt").write_text("\n".join(names) + "\n")
    return written


def _tenth_split(per_class: int, sample: int) -> str:
    return "test" if sample < per_class // 10 else "train"


def write_ncaltech101(root: Path, per_class: int = 10, classes: int = 4, events: int = 400, seed: int = 0) -> dict:
    """``root/Caltech101/<class>/image_<n>.bin`` in N-MNIST's 40-bit event format on the ATIS's 240x180 pixels; the
    first tenth of each class's samples are the test split."""
    rng = np.random.default_rng(seed)
    written = {"train": [], "test": []}
    for label, name in enumerate(["accordion", "airplanes", "anchor", "ant", "barrel", "bass"][:classes]):
        folder = root / "Caltech101" / name
        folder.mkdir(parents=True, exist_ok=True)
        for sample in range(per_class):
            x, y, t, p = class_events(label, classes, 180, events, rng)
            (folder / f"image_{sample + 1:04d}.bin").write_bytes(atis_bytes(x, y, t, p))
            written[_tenth_split(per_class, sample)].append((make_structured_array(x, y, t, p, dtype=XYTP), label))
    return written


def write_asl_dvs(root: Path, per_class: int = 10, classes: int = 4, events: int = 400, seed: int = 0) -> dict:
    """``root/<letter>/<letter>_<n>.mat``: MATLAB files of column vectors ``ts``, ``x``, ``y`` (bottom row 0) and
    ``pol`` on 240x180 pixels; the first tenth of each letter's samples are the test split."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    written = {"train": [], "test": []}
    for label, letter in enumerate("abcdefghiklmnopqrstuvwxy"[:classes]):
        (root / letter).mkdir(parents=True, exist_ok=True)
        for sample in range(per_class):
            x, y, t, p = class_events(label, classes, 180, events, rng)
            savemat(root / letter / f"{letter}_{sample + 1:04d}.mat",
                    {"ts": t[:, None], "x": x[:, None], "y": (179 - y)[:, None], "pol": p[:, None]})
            written[_tenth_split(per_class, sample)].append((make_structured_array(x, y, t, p, dtype=XYTP), label))
    return written


def write_dvs_lip(root: Path, per_class: int = 2, classes: int = 4, events: int = 400, seed: int = 0) -> dict:
    """``root/DVS-Lip/{train,test}/<word>/<n>.npy``: NumPy structured arrays of ``x``, ``y``, ``p``, ``t`` on
    128x128 pixels, the words the first of DVS-Lip's 100."""
    from tonic.datasets import DVSLip

    rng = np.random.default_rng(seed)
    written = {"train": [], "test": []}
    for split in written:
        for label, word in enumerate(DVSLip.classes[:classes]):
            folder = root / "DVS-Lip" / split / word
            folder.mkdir(parents=True, exist_ok=True)
            for sample in range(per_class):
                x, y, t, p = class_events(label, classes, 128, events, rng)
                np.save(folder / f"{sample}.npy", make_structured_array(x, y, p, t, dtype=DVSLip.dtype))
                written[split].append((make_structured_array(x, y, t, p, dtype=XYTP), label))
    return written
