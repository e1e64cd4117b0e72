"""Raw recordings of every format cut, truncated and byte-flipped, seeded: each try is refused in one line naming
the file, or read as what the changed bytes still say.

What "read exactly" can mean differs with where the bytes changed. A change in a header, a packet's bookkeeping
or an HDF5 file's structure must be refused, or leave the read unchanged (bytes no reader looks at). A flip inside
an event's own bytes (its x, y, time, polarity) or a sample's label makes another event or label of the same
format, on the sensor: no file a publisher ships carries a checksum, so that is read, and the fuzzer asserts that
it changed no more than one event or label for each byte flipped (an event may move between a trial's gestures).
A cut at an event boundary of a format that records no event count (N-MNIST, AEDAT 2.0, AEDAT 3.1 between packets)
leaves a shorter recording of the same events, which is read as such: the fuzzer asserts each sample then holds
only events of the intact one, but for the one event that a cut of whole events' length from inside an event
splices from the two it joins. Anything else read is a silent wrong value and fails; so do a traceback and a try that runs past ``HANG_S`` (HDF5's
library takes seconds on some damaged files: each try's time is reported).
"""

import collections
import functools
import signal
import time

import numpy as np
import pytest

from snnfw.config import Frames
from snnfw.errors import DataError
from snnfw.testing.raw_events import (write_asl_dvs, write_cifar10_dvs, write_dvs128_gesture, write_dvs_lip,
                                      write_ncaltech101, write_nmnist, write_shd)
from snnfw_plugins.datasets import event_formats, events

TRIES = 200  # per format
HANG_S = 60
FORMATS = {  # a tiny set, and the file of its train split the tries damage
    "n_mnist": (functools.partial(write_nmnist, per_class=1, classes=2, events=40), "Train/1/00000.bin"),
    "cifar10_dvs": (functools.partial(write_cifar10_dvs, per_class=2, classes=2, events=40),
                    "automobile/cifar10_automobile_1.aedat"),
    "dvs128_gesture": (functools.partial(write_dvs128_gesture, per_class=1, classes=2, events=40),
                       "DvsGesture/user01_led.aedat"),
    "shd": (functools.partial(write_shd, per_class=2, classes=2, events=20), "shd_train.h5"),
    "ssc": (functools.partial(write_shd, per_class=2, classes=2, events=20, prefix="ssc"), "ssc_train.h5"),
    "n_caltech101": (functools.partial(write_ncaltech101, per_class=1, classes=2, events=40),
                     "Caltech101/airplanes/image_0001.bin"),
    "asl_dvs": (functools.partial(write_asl_dvs, per_class=1, classes=2, events=40), "b/b_0001.mat"),
    "dvs_lip": (functools.partial(write_dvs_lip, per_class=1, classes=2, events=40), "DVS-Lip/train/action/0.npy"),
}


def read_split(name, root):
    """Every train sample of ``name`` as the frames cache reads it: listed, read, checked, integrated."""
    samples = []
    for recording, label in event_formats.SETS[name].recordings(root, "train"):
        read = event_formats.read(name, root, recording)
        events.to_frames(read, event_formats.SETS[name].sensor, 4, Frames())
        samples.append((label, collections.Counter(map(tuple, read.tolist()))))
    return samples


def damaged(data: bytes, rng: np.random.Generator) -> tuple[str, bytes, int]:
    """``data`` truncated, with a range cut out, or with 1 to 3 bytes flipped; and how many bytes were flipped."""
    kind = rng.choice(["truncate", "cut", "flip"], p=[0.25, 0.25, 0.5])
    if kind == "truncate":
        return kind, data[: rng.integers(0, len(data))], 0
    if kind == "cut":
        start = rng.integers(0, len(data))
        return kind, data[:start] + data[rng.integers(start + 1, len(data) + 1):], 0
    flipped = bytearray(data)
    places = rng.choice(len(data), rng.integers(1, 4), replace=False)
    for place in places:
        flipped[place] ^= int(rng.integers(1, 256))
    return kind, bytes(flipped), len(places)


def outcome(kind, intact, got, flips) -> str:
    if got == intact:
        return "exact"
    if len(got) != len(intact):
        return "silent"
    if kind == "flip":
        changed = sum((a != b) + (sum(((ea - eb) + (eb - ea)).values()) / 2) for (a, ea), (b, eb) in zip(intact, got))
        return "changed payload" if changed <= flips else "silent"
    spliced = sum(sum((eb - ea).values()) for (_, ea), (_, eb) in zip(intact, got))  # events not in the intact file
    kept = all(a == b for (a, _), (b, _) in zip(intact, got)) and spliced <= (kind == "cut")
    return "shortened" if kept else "silent"


class Hang(Exception):
    pass


def _hang(signum, frame):
    raise Hang


@pytest.mark.parametrize("name", FORMATS)
def test_damaged_raw_files_are_refused_in_one_line_or_read_as_their_bytes_say(tmp_path, name, capsys):
    write, damage = FORMATS[name]
    write(tmp_path)
    path = tmp_path / damage
    original = path.read_bytes()
    intact = read_split(name, tmp_path)
    rng = np.random.default_rng([51, list(FORMATS).index(name)])
    counts, silent, slowest = collections.Counter(), [], 0.0
    previous = signal.signal(signal.SIGALRM, _hang)
    try:
        for attempt in range(TRIES):
            kind, data, flips = damaged(original, rng)
            path.write_bytes(data)
            signal.alarm(HANG_S)
            began = time.perf_counter()
            try:
                result = outcome(kind, intact, read_split(name, tmp_path), flips)
            except DataError as err:
                message = str(err)
                assert "\n" not in message and str(path) in message, (attempt, kind, message)
                result = "refused"
            finally:
                signal.alarm(0)
                slowest = max(slowest, time.perf_counter() - began)
            counts[result] += 1
            if result == "silent":
                silent.append((attempt, kind))
    finally:
        signal.signal(signal.SIGALRM, previous)
        path.write_bytes(original)
    with capsys.disabled():
        print(f"\n{name}: {TRIES} tries, {dict(sorted(counts.items()))}, the slowest {slowest:.2f} s")
    assert not silent, silent
    assert counts["refused"] >= TRIES // 4


def test_a_sample_whose_stored_length_claims_more_than_the_file_is_refused_before_hdf5_allocates_it(tmp_path):
    """A flipped high byte of a spike train's length claims billions of values; HDF5 would allocate them first."""
    import h5py

    write_shd(tmp_path, per_class=2, classes=2, events=20)
    path = tmp_path / "shd_train.h5"
    with h5py.File(path, "r") as opened:
        descriptor = opened["spikes/times"].id.get_offset() + 16  # sample 1's (length, heap address, heap index)
    data = bytearray(path.read_bytes())
    data[descriptor + 3] = 0x88
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"its sample 1 of spikes/times claims 2281701396 values, more than the "
                                        r"file's \d+ bytes hold"):
        read_split("shd", tmp_path)
