"""The raw event recordings of each data set, in the layout its publisher ships, read into tonic's events.

- ``n_mnist``: ``Train/<digit>/*.bin`` and ``Test/<digit>/*.bin`` (``train.zip`` and ``test.zip`` unpacked), read
  with tonic's reader.
- ``cifar10_dvs``: ``<class>/*.aedat`` (the ten class zips unpacked), AEDAT 2.0 decoded as SpikingJelly decodes
  it; the first tenth of each class by sample number tests (TEBN's split).
- ``dvs128_gesture``: ``DvsGesture/`` (``DvsGesture.tar.gz`` unpacked): AEDAT 3.1 trials, one sample per gesture
  span of their ``*_labels.csv``, split by ``trials_to_train.txt`` and ``trials_to_test.txt``.
- ``shd``: ``shd_train.h5`` and ``shd_test.h5`` (gunzipped), read as tonic's SHD reads them; ``ssc``:
  ``ssc_train.h5`` and ``ssc_test.h5`` alike (SSC's validation file is not read).
- ``n_caltech101``: ``Caltech101/<class>/*.bin`` (``Caltech101.zip`` of the N-Caltech101 archive unpacked), N-MNIST's
  event format on the ATIS's 240x180 pixels (no timestamp-overflow markers, as for N-MNIST), read with tonic's reader (not shifted to the recording's corner as
  tonic's NCALTECH101 shifts it, so frames keep one sensor); split as CIFAR10-DVS is (no official split).
- ``asl_dvs``: ``<letter>/*.mat`` (the ``Yin*.zip`` archives unpacked), read as tonic's ASLDVS reads them (MATLAB
  files of ``ts``, ``x``, ``y``, ``pol``; y flipped on the 240x180 sensor); the 24 letters numbered in sorted order,
  split as CIFAR10-DVS is (no official split).
- ``dvs_lip``: ``DVS-Lip/train/<word>/*.npy`` and ``DVS-Lip/test/<word>/*.npy`` (``DVS-Lip.zip`` unpacked): NumPy
  structured arrays of ``x``, ``y``, ``p``, ``t`` on 128x128 pixels, read as tonic's DVSLip reads them, words
  numbered by tonic's list of the 100 (sorted).

:data:`URLS` says where each is fetched from; nothing is downloaded. Every file is checked where it is opened,
listing included: one that is empty, cut, or not in its format's layout raises :class:`BadRecording` naming it
and what is wrong, as does a recording whose events fall outside the sensor (:func:`check_events`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import struct
from pathlib import Path
from typing import Callable

import attrs
import numpy as np

from snnfw.api import DataError, said

URLS = {
    "n_mnist": "https://www.garrickorchard.com/datasets/n-mnist (train.zip and test.zip, unzipped into data.root)",
    "cifar10_dvs": "https://figshare.com/articles/dataset/CIFAR10-DVS_New/4724671 (the ten class zips, unzipped "
                   "into data.root)",
    "dvs128_gesture": "https://research.ibm.com/interactive/dvsgesture/ (DvsGesture.tar.gz, unpacked into "
                      "data.root)",
    "shd": "https://zenkelab.org/datasets/ (shd_train.h5.gz and shd_test.h5.gz, gunzipped into data.root)",
    "ssc": "https://zenkelab.org/datasets/ (ssc_train.h5.gz and ssc_test.h5.gz, gunzipped into data.root)",
    "n_caltech101": "https://www.garrickorchard.com/datasets/n-caltech101 (the archive's Caltech101.zip, unzipped "
                    "into data.root)",
    "asl_dvs": "https://github.com/PIX2NVS/NVS2Graph (ASL-DVS: its Yin*.zip archives, unzipped into data.root)",
    "dvs_lip": "https://sites.google.com/view/event-based-lipreading (DVS-Lip.zip, unzipped into data.root)",
}


class BadRecording(DataError):
    """A raw file of data set ``name`` that is not as its publisher ships it: ``path`` and what is wrong with it."""

    def __init__(self, name: str, path: Path, what: str):
        super().__init__(f"{path} is not a {name} recording as its publisher ships it: {what}; get it again from "
                         f"{URLS[name]}")
        self.path = path


# what libraries raise on a file that is not what they read (h5py: OSError, KeyError, TypeError; numpy's loadtxt:
# ValueError; struct: struct.error)
_UNREADABLE = (OSError, ValueError, KeyError, IndexError, TypeError, struct.error, UnicodeDecodeError, AssertionError)


@contextlib.contextmanager
def opening(path: Path, name: str):
    """Turns a failure to read ``path``, a file of data set ``name``, into :class:`BadRecording` naming it."""
    try:
        yield
    except BadRecording:
        raise
    except _UNREADABLE as err:
        reason = said(err, 200) or type(err).__name__
        if isinstance(err, OSError) and "signature not found" in reason:
            reason = "it is not an HDF5 file"
        raise BadRecording(name, path, reason) from None


def check_events(events: np.ndarray, sensor: tuple[int, int, int]) -> np.ndarray:
    """``events`` if they are some and lie on the sensor (W, H, P) at times from 0; ValueError saying which not.
    (A sensor of one polarity counts every event in it, as tonic's ToFrame does.)"""
    if len(events) == 0:
        raise ValueError("it holds no events")
    limits = {"x": sensor[0], "y": sensor[1], **({"p": sensor[2]} if sensor[2] > 1 else {})}
    for field in events.dtype.names:
        values = events[field]
        low, high = values.min(), values.max()
        if field == "t" and low < 0:
            raise ValueError(f"it holds an event at time {low}, before 0")
        if field in limits and (low < 0 or high >= limits[field]):
            raise ValueError(f"it holds an event of {field} = {low if low < 0 else high}, outside the sensor's "
                             f"0 to {limits[field] - 1}")
    return events


@attrs.frozen
class RawSet:
    """One publisher's layout: the recordings of a split, how to read one, and the sensor's (W, H, P)."""

    recordings: Callable[[Path, str], list[tuple[object, int]]]  # (root, split) -> [(recording, label)]
    read: Callable[[Path, object], np.ndarray]  # (root, recording) -> tonic's structured events
    sensor: tuple[int, int, int]
    fingerprint: Callable[[Path, str], list]  # (root, split) -> what the cache key covers of the raw files
    source: Callable[[Path, object], Path]  # (root, recording) -> the file it is read from


def _itself(root: Path, path: Path) -> Path:
    return path


def _file_stats(files: list[Path], root: Path) -> list:
    return [(str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


# N-MNIST: one .bin per sample in a folder named by its digit.
_NMNIST = {"train": "Train", "test": "Test"}


def _nmnist_files(root: Path, split: str) -> list[tuple[Path, int]]:
    folder = root / _NMNIST[split]
    digits = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()) if folder.is_dir() else []
    return [(f, int(d.name)) for d in digits for f in sorted(d.glob("*.bin"))]


def _nmnist_read(root: Path, path: Path) -> np.ndarray:
    """tonic's reader, on a file checked first: whole 5-byte events, each on the 34x34 sensor (so none of the
    format's time-overflow markers, y = 240, which 0.3 s recordings of 23-bit microsecond times never need)."""
    raw = _five_byte_events(path, "N-MNIST events")
    if (corner := max(raw[0::5].max(), raw[1::5].max())) >= 34:
        raise ValueError(f"it holds an event at x or y = {corner}, outside the 34x34 sensor")
    return _read_five_byte_events(path)


def _five_byte_events(path: Path, kind: str) -> np.ndarray:
    """The bytes of a file of N-MNIST's 5-byte events (``kind``, for the message), refused empty or cut."""
    raw = np.frombuffer(path.read_bytes(), np.uint8)
    if len(raw) == 0:
        raise ValueError("it is empty")
    if len(raw) % 5:
        raise ValueError(f"its events are cut: it has {len(raw)} bytes, and {kind} are 5 bytes each")
    return raw


def _read_five_byte_events(path: Path) -> np.ndarray:
    """tonic's reader of N-MNIST's format, on a file :func:`_five_byte_events` checked."""
    from tonic.io import read_mnist_file

    return read_mnist_file(str(path), dtype=np.dtype([("x", int), ("y", int), ("t", int), ("p", int)]))


# CIFAR10-DVS: one AEDAT 2.0 file per sample in a folder named by its class; the first tenth of each class by
# sample number tests (TEBN's split, as the frames reader splits SpikingJelly's folders).
def tebn_split(classes: list[list[Path]], split: str) -> list[tuple[Path, int]]:
    """``(file, label)`` of ``split`` from each class's files: the first tenth by sample number tests."""
    samples = []
    for label, files in enumerate(classes):
        files = sorted(files, key=_number)
        cut = len(files) // 10
        samples += [(f, label) for f in (files[:cut] if split == "test" else files[cut:])]
    return samples


def _number(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)$", path.stem)
    return (int(match.group(1)) if match else -1, path.name)


def _cifar10_dvs_files(root: Path, split: str) -> list[tuple[Path, int]]:
    classes = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.aedat"))) if root.is_dir() else []
    return tebn_split([sorted(c.glob("*.aedat")) for c in classes], split)


def _cifar10_dvs_read(root: Path, path: Path) -> np.ndarray:
    """Decoded as SpikingJelly's CIFAR10DVS decodes the publisher's files (x and y mirrored, polarity flipped),
    after a header of ``#`` lines of text, the first ``#!AER-DAT2.0``; addresses are the DVS128's 15 bits (and its
    external-event flag), so a byte of text read as an event is refused."""
    from tonic.io import make_structured_array

    data = path.read_bytes()
    if not data.startswith(b"#!AER-DAT2.0\r\n"):
        raise ValueError("it does not begin with the AEDAT 2.0 header line #!AER-DAT2.0")
    start = 0
    while data.startswith(b"#", start):
        end = data.find(b"\r\n", start) + 2
        if end < 2 or any(byte < 32 or byte == 127 for byte in data[start:end - 2]):
            raise ValueError(f"its header line at byte {start} is not a line of text ending in \\r\\n")
        start = end
    if (len(data) - start) % 8:
        raise ValueError("its events are cut: AEDAT 2.0 events are 8 bytes each")
    raw = np.frombuffer(data, ">u4", offset=start).reshape(-1, 2).astype(np.int64)
    address, t = raw[:, 0], raw[:, 1]
    if len(address) and (wide := int(address.max())) >> 16:
        raise ValueError(f"it holds an event address {wide:#x}, wider than the DVS128's 16 bits")
    x, y, p = (address & 0xFE) >> 1, (address & 0x7F00) >> 8, address & 1
    return make_structured_array(127 - y, 127 - x, t, 1 - p)


# DVS128 Gesture: one AEDAT 3.1 file per trial (a user under a lighting), its gestures' classes and time spans in
# a CSV beside it; trials_to_train.txt and trials_to_test.txt list the trials of each split.
GESTURES = 11


def _gesture_recordings(root: Path, split: str) -> list[tuple[tuple[Path, int, int], int]]:
    folder = root / "DvsGesture"
    listed = folder / f"trials_to_{split}.txt"
    if not listed.is_file():
        return []
    recordings = []
    with opening(listed, "dvs128_gesture"):
        trials = listed.read_text(encoding="ascii").split()
    for trial in trials:
        if not trial.endswith(".aedat") or not (folder / trial).is_file():
            raise BadRecording("dvs128_gesture", listed, f"it lists {trial!r}, which is not an .aedat file in {folder}")
        labels = folder / trial.replace(".aedat", "_labels.csv")
        with opening(labels, "dvs128_gesture"):
            spans = np.loadtxt(labels, dtype=np.int64, delimiter=",", skiprows=1, ndmin=2)
            if spans.shape[1] != 3 or not (1 <= spans[:, 0]).all() or not (spans[:, 0] <= GESTURES).all() or (
                    spans[:, 1] >= spans[:, 2]).any():
                raise ValueError(f"its rows are not class (1 to {GESTURES}), startTime_usec, endTime_usec with the "
                                 "start before the end")
        recordings += [((folder / trial, start, end), int(label) - 1) for label, start, end in spans]
    return recordings


def _aedat3_polarity_events(path: Path) -> np.ndarray:
    """The polarity events (type 1) of an AEDAT 3.1 file, decoded as SpikingJelly's ``load_aedat_v3`` does."""
    return _aedat3_decoded(path, *(lambda stat: (stat.st_size, stat.st_mtime_ns))(path.stat()))


@functools.lru_cache(maxsize=2)  # a trial's gestures are read one after another; the file's size and time key it
def _aedat3_decoded(path: Path, size: int, mtime_ns: int) -> np.ndarray:
    """Checked as it is decoded: the DVS128 writes special (type 0) and polarity (type 1) packets of 8-byte events,
    their timestamps' overflow counter starting at 0 and counting up by one."""
    from tonic.io import make_structured_array

    data = path.read_bytes()
    if not data.startswith(b"#!AER-DAT3.1\r\n") or b"#!END-HEADER\r\n" not in data:
        raise ValueError("it is not an AEDAT 3.1 file (#!AER-DAT3.1, then a header ending in #!END-HEADER)")
    start = data.index(b"#!END-HEADER\r\n") + len(b"#!END-HEADER\r\n")
    packets, offset, counted = [], start, 0
    while offset < len(data):
        if offset + 28 > len(data):
            raise ValueError("its last event packet is cut")
        kind, _, size, ts_offset, overflow, capacity, number, valid = struct.unpack_from("<HHIIIIII", data, offset)
        if kind not in (0, 1) or size != 8 or ts_offset != 4 or not valid <= number <= capacity:
            raise ValueError(f"its event packet at byte {offset} is not a DVS128's (type {kind}, {size}-byte events)")
        if overflow not in (counted, counted + 1):
            raise ValueError(f"its event packet at byte {offset} counts {overflow} timestamp overflows after "
                             f"{counted}")
        counted, body = overflow, offset + 28
        if body + capacity * size > len(data):
            raise ValueError("its last event packet is cut")
        if kind == 1:
            words = np.frombuffer(data, "<u4", capacity * size // 4, body).reshape(capacity, size // 4)
            packets.append((words[:, 0].astype(np.int64), words[:, 1].astype(np.int64) | int(overflow) << 31))
        offset = body + capacity * size
    address = np.concatenate([a for a, _ in packets]) if packets else np.zeros(0, np.int64)
    t = np.concatenate([t for _, t in packets]) if packets else np.zeros(0, np.int64)
    return make_structured_array((address >> 17) & 0x7FFF, (address >> 2) & 0x7FFF, t, (address >> 1) & 1)


def _gesture_read(root: Path, key: tuple[Path, int, int]) -> np.ndarray:
    path, start, end = key
    events = _aedat3_polarity_events(path)
    return events[(events["t"] >= start) & (events["t"] < end)]


def _gesture_files(root: Path, split: str) -> list[Path]:
    folder = root / "DvsGesture"
    trials = sorted({key[0] for key, _ in _gesture_recordings(root, split)})
    files = [folder / f"trials_to_{split}.txt", *trials, *(t.with_name(t.stem + "_labels.csv") for t in trials)]
    return [f for f in files if f.exists()]


# SHD and SSC: one HDF5 file per split, spike times in seconds and channel numbers per sample.
def _check_vlen_length(opened, name: str, index: int, path: Path) -> None:
    """Refuses sample ``index`` of variable-length dataset ``name`` if its stored length claims more values than the
    file holds: HDF5 would allocate them all first (a flipped high byte claims gigabytes, and takes half a minute to
    refuse). Read from the sample's descriptor (length, heap address, heap index) where the data is contiguous."""
    import h5py

    dataset = opened[name]
    offset, base = dataset.id.get_offset(), h5py.check_vlen_dtype(dataset.dtype)
    if offset is None or base is None or not 0 <= index < len(dataset):
        return
    address_bytes = opened.id.get_create_plist().get_sizes()[0]
    with open(path, "rb") as raw:
        raw.seek(offset + index * (4 + address_bytes + 4))
        length = int.from_bytes(raw.read(4), "little")
    if length * base.itemsize > path.stat().st_size:
        raise ValueError(f"its sample {index} of {name} claims {length} values, more than the file's "
                         f"{path.stat().st_size} bytes hold")


def _heidelberg(prefix: str) -> RawSet:
    def file(root: Path, split: str) -> Path:
        return root / f"{prefix}_{split}.h5"

    def recordings(root: Path, split: str) -> list[tuple[tuple[str, int], int]]:
        import h5py

        if not file(root, split).is_file():
            return []
        with opening(file(root, split), prefix), h5py.File(file(root, split), "r") as opened:
            labels = opened["labels"][()]
            samples = [len(opened[key]) for key in ("spikes/times", "spikes/units")]
            if labels.ndim != 1 or labels.dtype.kind not in "iu" or samples != [len(labels)] * 2:
                raise ValueError(f"its labels ({labels.dtype}, shape {labels.shape}) are not one integer per sample "
                                 f"of spikes/times and spikes/units ({samples[0]} and {samples[1]})")
            return [((split, index), int(label)) for index, label in enumerate(labels)]

    def read(root: Path, key: tuple[str, int]) -> np.ndarray:
        """As tonic's SHD reads a sample: times in microseconds, the channel as x, polarity 1."""
        import h5py
        from tonic.io import make_structured_array

        split, index = key
        with h5py.File(file(root, split), "r") as opened:
            for name in ("spikes/times", "spikes/units"):
                _check_vlen_length(opened, name, index, file(root, split))
            times, units = opened["spikes/times"][index], opened["spikes/units"][index]
        if len(times) != len(units) or not np.isfinite(times).all() or (times < 0).any():
            raise ValueError(f"its sample {index} has {len(times)} spike times and {len(units)} channels, which are "
                             "not as many finite times from 0 as channels")
        return make_structured_array(times.astype(np.float64) * 1e6, units, 1,
                                     dtype=np.dtype([("t", int), ("x", int), ("p", int)]))

    return RawSet(recordings, read, (700, 1, 1), lambda root, split: _file_stats([file(root, split)], root),
                  lambda root, key: file(root, key[0]))


# N-Caltech101: N-MNIST's 5-byte events from the ATIS (x < 240, y < 180), one .bin per sample in a folder named by
# its class; none of the format's timestamp-overflow markers (y = 240), which 0.3 s recordings of 23-bit
# microsecond times never need, as for N-MNIST.
ATIS = (240, 180)


def _caltech_files(root: Path, split: str) -> list[tuple[Path, int]]:
    folder = root / "Caltech101"
    classes = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    return tebn_split([sorted(c.glob("*.bin")) for c in classes], split)


def _caltech_read(root: Path, path: Path) -> np.ndarray:
    raw = _five_byte_events(path, "its events")
    for field, values, limit in (("x", raw[0::5], ATIS[0]), ("y", raw[1::5], ATIS[1])):
        if (high := int(values.max())) >= limit:
            raise ValueError(f"it holds an event at {field} = {high}, outside the ATIS's {ATIS[0]}x{ATIS[1]} pixels")
    return _read_five_byte_events(path)


# ASL-DVS: one MATLAB file per sample in a folder named by its letter.
def _asl_files(root: Path, split: str) -> list[tuple[Path, int]]:
    letters = sorted(p for p in root.iterdir() if p.is_dir() and len(p.name) == 1 and p.name.islower()) \
        if root.is_dir() else []
    return tebn_split([sorted(c.glob("*.mat")) for c in letters], split)


def _asl_read(root: Path, path: Path) -> np.ndarray:
    from scipy.io import loadmat
    from scipy.io.matlab import MatReadError
    from tonic.io import make_structured_array

    try:
        fields = loadmat(path, variable_names=("ts", "x", "y", "pol"))
    except (MatReadError, UnboundLocalError, NotImplementedError, OverflowError, *_UNREADABLE) as err:  # scipy's, on damage
        raise ValueError(f"it is not a MATLAB file scipy reads ({said(err, 120)})") from None
    if missing := [key for key in ("ts", "x", "y", "pol") if key not in fields]:
        raise ValueError(f"it holds no {', '.join(missing)}")
    ts, x, y, pol = (np.asarray(fields[key]).ravel() for key in ("ts", "x", "y", "pol"))
    if not len(ts) == len(x) == len(y) == len(pol):
        raise ValueError(f"its ts, x, y and pol hold {len(ts)}, {len(x)}, {len(y)} and {len(pol)} values, not one per event")
    return make_structured_array(ts, x, ATIS[1] - 1 - y.astype(np.int64), pol,
                                 dtype=np.dtype([("t", int), ("x", int), ("y", int), ("p", int)]))


# DVS-Lip: one NumPy structured array per sample, in a folder named by its word, under train/ and test/.
def _lip_files(root: Path, split: str) -> list[tuple[Path, int]]:
    from tonic.datasets import DVSLip

    folder = root / "DVS-Lip" / split
    words = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if stray := next((w for w in words if w.name not in DVSLip.classes), None):
        raise BadRecording("dvs_lip", stray, "it is a folder of no word of DVS-Lip's 100")
    return [(f, DVSLip.classes.index(w.name)) for w in words for f in sorted(w.glob("*.npy"))]


def _lip_read(root: Path, path: Path) -> np.ndarray:
    from tonic.io import make_structured_array

    import tokenize

    from numpy.lib import format as npy

    try:
        with path.open("rb") as file:  # the header says how many events follow: as many bytes must, no more
            header = npy.read_array_header_1_0 if npy.read_magic(file) == (1, 0) else npy.read_array_header_2_0
            shape, _, dtype = header(file)
            if (size := path.stat().st_size) != file.tell() + int(np.prod(shape)) * dtype.itemsize:
                raise ValueError(f"it has {size} bytes, not the {file.tell()} of its header and the events it "
                                 f"announces, {list(shape)} of {dtype.itemsize} bytes")
        recorded = np.load(path, allow_pickle=False)
    except (SyntaxError, tokenize.TokenError, EOFError) as err:  # a damaged header, read by ast.literal_eval
        raise ValueError(f"its .npy header is damaged ({err.__class__.__name__})") from None
    if recorded.dtype.names is None or not {"x", "y", "p", "t"} <= set(recorded.dtype.names) or recorded.ndim != 1:
        raise ValueError(f"it holds {recorded.dtype} {list(recorded.shape)}, not a list of events with fields x, y, p, t")
    return make_structured_array(recorded["x"], recorded["y"], recorded["p"], recorded["t"],
                                 dtype=np.dtype([("x", int), ("y", int), ("p", int), ("t", int)]))


def _listed(files: Callable[[Path, str], list[tuple[Path, int]]]) -> Callable[[Path, str], list]:
    return lambda root, split: _file_stats([f for f, _ in files(root, split)], root)


SETS = {
    "n_mnist": RawSet(_nmnist_files, _nmnist_read, (34, 34, 2),
                      lambda root, split: _file_stats([f for f, _ in _nmnist_files(root, split)], root), _itself),
    "cifar10_dvs": RawSet(_cifar10_dvs_files, _cifar10_dvs_read, (128, 128, 2),
                          lambda root, split: _file_stats([f for f, _ in _cifar10_dvs_files(root, split)], root),
                          _itself),
    "dvs128_gesture": RawSet(_gesture_recordings, _gesture_read, (128, 128, 2),
                             lambda root, split: _file_stats(_gesture_files(root, split), root),
                             lambda root, key: key[0]),
    "shd": _heidelberg("shd"),
    "ssc": _heidelberg("ssc"),
    "n_caltech101": RawSet(_caltech_files, _caltech_read, (*ATIS, 2), _listed(_caltech_files), _itself),
    "asl_dvs": RawSet(_asl_files, _asl_read, (*ATIS, 2), _listed(_asl_files), _itself),
    "dvs_lip": RawSet(_lip_files, _lip_read, (128, 128, 2), _listed(_lip_files), _itself),
}


def read(name: str, root: Path, recording) -> np.ndarray:
    """Recording ``recording`` of data set ``name``, checked (:class:`BadRecording` if it is not as shipped)."""
    raw = SETS[name]
    with opening(raw.source(root, recording), name):
        return check_events(raw.read(root, recording), raw.sensor)


def holds_events(name: str, root: Path) -> bool:
    """Whether ``root`` holds data set ``name``'s raw recordings (of either split)."""
    return name in SETS and any(SETS[name].recordings(root, split) for split in ("train", "test"))
