"""Raw event recordings: read in their publishers' formats, integrated by tonic's ToFrame, cached once."""

import functools
import re
import importlib.util
import sys
import types
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from tonic.transforms import Denoise, ToFrame

from snnfw.config import build_config
from snnfw.data.batches import InputSpec
from snnfw.errors import DataError
from snnfw.testing.raw_events import (write_asl_dvs, write_cifar10_dvs, write_dvs128_gesture, write_dvs_lip,
                                      write_ncaltech101, write_nmnist, write_shd)
from snnfw_plugins.datasets import event_formats, events, neuromorphic

WRITERS = {"n_mnist": write_nmnist, "cifar10_dvs": write_cifar10_dvs, "dvs128_gesture": write_dvs128_gesture,
           "shd": write_shd, "ssc": functools.partial(write_shd, prefix="ssc"), "n_caltech101": write_ncaltech101,
           "asl_dvs": write_asl_dvs, "dvs_lip": write_dvs_lip}
T = 6


def data_config(name, root, **data):
    return build_config({"data": {"name": name, "root": str(root), **data}}).data


@pytest.mark.parametrize("frames", [{"by": "count"}, {"by": "time"}, {"by": "time", "denoise_us": 20000}],
                         ids=["count", "time", "denoised"])
@pytest.mark.parametrize("name", WRITERS)
def test_frames_are_tonics_toframe_of_the_recorded_events(tmp_path, name, frames):
    if name in ("shd", "ssc") and "denoise_us" in frames:
        with pytest.raises(DataError, match=f"{name} records channels, not pixels; remove it"):
            events.cached_frames(data_config(name, tmp_path, frames=frames), name, "train", T)
        return
    written = WRITERS[name](tmp_path)
    config = data_config(name, tmp_path, frames=frames)
    sensor = event_formats.SETS[name].sensor
    bins = {"n_time_bins": T} if frames["by"] == "time" else {"n_event_bins": T}
    for split in ("train", "test"):
        cached, labels = events.cached_frames(config, name, split, T)
        assert labels.tolist() == [label for _, label in written[split]]
        for index, (recorded, _) in enumerate(written[split]):
            if "denoise_us" in frames:
                recorded = Denoise(filter_time=frames["denoise_us"])(recorded)
            expected = ToFrame(sensor_size=sensor, **bins)(recorded)
            assert cached[index].shape == (T, sensor[2], sensor[1], sensor[0])
            assert np.array_equal(cached[index].reshape(expected.shape), expected), (split, index)


def test_the_cache_is_read_without_the_raw_files_and_made_again_when_its_settings_change(tmp_path, monkeypatch):
    write_nmnist(tmp_path)
    first = events.cached_frames(data_config("n_mnist", tmp_path), "n_mnist", "train", T)[0].copy()

    def unread(root, recording):
        raise AssertionError(f"{recording} was read again")

    monkeypatch.setitem(event_formats.SETS, "n_mnist", attrs.evolve(event_formats.SETS["n_mnist"], read=unread))
    assert np.array_equal(events.cached_frames(data_config("n_mnist", tmp_path), "n_mnist", "train", T)[0], first)
    for changed in ({"frames": {"by": "time"}}, {"frames": {"denoise_us": 5}}):
        with pytest.raises(DataError, match="was read again"):
            events.cached_frames(data_config("n_mnist", tmp_path, **changed), "n_mnist", "train", T)
    with pytest.raises(DataError, match="was read again"):
        events.cached_frames(data_config("n_mnist", tmp_path), "n_mnist", "train", T + 2)
    (tmp_path / "Train" / "0" / "00000.bin").write_bytes(b"\x01\x02\x03\x04\x05")  # the raw set changed
    with pytest.raises(DataError, match="was read again"):
        events.cached_frames(data_config("n_mnist", tmp_path), "n_mnist", "train", T)


def test_the_cache_goes_where_data_cache_says(tmp_path):
    write_shd(tmp_path / "raw")
    events.cached_frames(data_config("shd", tmp_path / "raw", cache=str(tmp_path / "frames")), "shd", "test", T)
    assert [p.name.split("-")[:3] for p in (tmp_path / "frames").iterdir() if not p.name.startswith(".")] == [
        ["shd", "test", f"T{T}"]]
    assert not (tmp_path / "raw" / ".snnfw-frames").exists()


def test_a_data_set_item_is_resized_float_frames_and_its_label(tmp_path):
    write_nmnist(tmp_path)
    spec = InputSpec(time_steps=T, shape=(2, 32, 32), num_classes=10)
    dataset = neuromorphic.builder("n_mnist")(data_config("n_mnist", tmp_path), spec, "train", 0)
    frames, label = dataset[5]
    assert len(dataset) == 16 and frames.shape == (T, 2, 32, 32) and frames.dtype.is_floating_point and label == 1


@pytest.mark.parametrize("name, setting, refusal", [
    ("shd", {}, r"data set shd reads its raw recordings from data.root, and .* holds none; get them from "
                r"https://zenkelab.org/datasets/ \(shd_train.h5.gz"),
    ("ssc", {}, r"data set ssc reads its raw recordings from data.root, and .* holds none; get them from "
                r"https://zenkelab.org/datasets/ \(ssc_train.h5.gz"),
    ("n_mnist", {}, r"frames_number_6_split_by_number does not exist: .*; or the raw recordings from "
                    r"https://www.garrickorchard.com/datasets/n-mnist"),
])
def test_a_missing_data_set_names_where_to_fetch_it(tmp_path, name, setting, refusal):
    spec = InputSpec(time_steps=T, shape=(2, 32, 32), num_classes=10)
    build = neuromorphic.builder(name) if name in neuromorphic.SETS else events.builder(name)
    with pytest.raises(DataError, match=refusal):
        build(data_config(name, tmp_path, **setting), spec, "train", 0)


def test_a_cut_recording_is_refused_naming_the_file_and_the_url(tmp_path):
    write_cifar10_dvs(tmp_path)
    (tmp_path / "bird" / "cifar10_bird_3.aedat").write_bytes(b"#!AER-DAT2.0\r\n\x00\x00\x00")
    with pytest.raises(DataError, match=r"cifar10_bird_3.aedat is not a cifar10_dvs recording .* get it again "
                                        r"from https://figshare.com"):
        events.cached_frames(data_config("cifar10_dvs", tmp_path), "cifar10_dvs", "train", T)


def test_a_model_of_other_channels_or_fewer_classes_is_refused_naming_the_key(tmp_path):
    write_shd(tmp_path, classes=4)
    build = events.builder("shd")
    with pytest.raises(DataError, match=r"shd frames have 1 channels .* model.input_shape = \[1, H, W\]\)"):
        build(data_config("shd", tmp_path), InputSpec(T, (2, 32, 32), 10), "train", 0)
    with pytest.raises(DataError, match="shd has 4 classes, but the model has 3 outputs; set model.num_classes = 4"):
        build(data_config("shd", tmp_path), InputSpec(T, (1, 1, 700), 3), "train", 0)


def test_the_plan_fits_a_familys_classes_to_the_data_set_and_says_how_frames_are_resized(tmp_path):
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    write_dvs128_gesture(tmp_path)
    settings = {"data": {"name": "dvs128_gesture", "root": str(tmp_path), "batch_size": 2}, "train": {"epochs": 1}}
    prepared = prepare(build_config({**settings, "model": {"time_steps": T}}), 1, Plugins())
    assert prepared.plan.config.model.num_classes == 11 and prepared.spec.num_classes == 11
    said = " | ".join(prepared.plan.rationale)
    assert "model.num_classes = 11: data set dvs128_gesture's classes (flavor tiny has 10" in said
    assert "frames of data set dvs128_gesture resized by area from 128x128 to the model's 32x32" in said
    assert len(prepared.datasets[0]) == 8  # two trials of four gestures
    chosen = prepare(build_config({**settings, "model": {"time_steps": T, "num_classes": 12}}), 1, Plugins())
    assert chosen.plan.config.model.num_classes == 12 and "model.num_classes = 11" not in " ".join(chosen.plan.rationale)


def test_event_augments_transform_the_recorded_events_with_tonic_seeded_per_sample(tmp_path):
    from tonic.transforms import DropEvent, TimeJitter

    from snnfw.data.augment import Augmented, augment_options, sample_seed

    written = write_nmnist(tmp_path)
    config = data_config("n_mnist", tmp_path, augment=["drop_event", "time_jitter", "hflip"], drop_event_p=0.3,
                         frames={"by": "time"})
    spec = InputSpec(time_steps=T, shape=(2, 34, 34), num_classes=10)
    train = neuromorphic.builder("n_mnist")(config, spec, "train", 0)
    augmented = Augmented(train, config.augment, augment_options(config), seed=5)
    first, again, later = augmented[3], augmented[3], augmented[len(train) + 3]  # epoch 0 twice, then epoch 1
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], later[0]) and first[1] == written["train"][3][1]
    state = np.random.get_state()
    np.random.seed(sample_seed(5, 0, 3) % 2**32)
    events = TimeJitter(std=100.0, clip_negative=True, sort_timestamps=True)(DropEvent(p=0.3)(written["train"][3][0]))
    np.random.set_state(state)
    expected = torch.from_numpy(ToFrame(sensor_size=(34, 34, 2), n_time_bins=T)(events).astype(np.float32))
    assert torch.equal(first[0], expected) or torch.equal(first[0], expected.flip(-1))  # hflip comes after
    assert first[0].sum() < 0.8 * torch.from_numpy(np.asarray(train.frames[3], dtype=np.float32)).sum()


def test_event_augments_are_refused_where_there_are_no_events(tmp_path):
    from snnfw.data.augment import Augmented, augment_options

    write_shd(tmp_path)
    shd = data_config("shd", tmp_path, augment=["spatial_jitter"])
    with pytest.raises(DataError, match="'spatial_jitter' moves events in the pixel grid, and shd records channels"):
        events.builder("shd")(shd, InputSpec(T, (1, 1, 700), 20), "train", 0)
    frames = [(torch.zeros(T, 2, 8, 8), 0)]
    with pytest.raises(DataError, match="data.augment's 'drop_event' transform raw events before they become frames"):
        Augmented(frames, ("drop_event",), augment_options(shd), seed=0)


def spikingjelly_integration(monkeypatch):
    """SpikingJelly's ``integrate_events_by_fixed_frames_number``: from ``spikingjelly.datasets``, or, where that does
    not import (its data set classes need torchvision, whose PyPI wheels do not load beside a CPU torch), from the
    module that defines it, with the torchvision it imports but does not use for it stubbed."""
    try:
        from spikingjelly.datasets import integrate_events_by_fixed_frames_number
        return integrate_events_by_fixed_frames_number
    except ImportError:
        import spikingjelly
    stub = types.ModuleType("torchvision")
    stub.transforms = types.ModuleType("torchvision.transforms")
    monkeypatch.setitem(sys.modules, "torchvision", stub)
    path = Path(spikingjelly.__file__).parent / "datasets" / "utils.py"
    spec = importlib.util.spec_from_file_location("spikingjelly.datasets.utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.integrate_events_by_fixed_frames_number


@pytest.mark.parametrize("name", ["n_mnist", "cifar10_dvs", "dvs128_gesture"])
def test_frames_by_count_are_spikingjellys_split_by_number_but_for_the_remainder(tmp_path, monkeypatch, name):
    """tonic's bins hold N // T events each and leave out the last N % T, which SpikingJelly adds to its last frame."""
    integrate = spikingjelly_integration(monkeypatch)
    written = WRITERS[name](tmp_path)
    frames, _ = events.cached_frames(data_config(name, tmp_path, frames={"by": "count"}), name, "train", T)
    width, height, _ = event_formats.SETS[name].sensor
    remainders = set()
    for index, (recorded, _) in enumerate(written["train"]):
        theirs = integrate({key: recorded[key].astype(np.int64) for key in "txyp"}, "number", T, height, width)
        left_out = recorded[len(recorded) - len(recorded) % T:]
        np.subtract.at(theirs[-1], (left_out["p"], left_out["y"], left_out["x"]), 1)
        assert np.array_equal(np.asarray(frames[index]), theirs), index
        remainders.add(len(left_out))
    assert remainders != {0} or name == "cifar10_dvs"  # the remainder was there to tell apart (600 events split evenly)


def refusal(name, root, split="train"):
    """The one-line DataError that integrating ``split`` raises, and what the cache holds after it."""
    with pytest.raises(DataError) as refused:
        events.cached_frames(data_config(name, root, cache=str(root / "cache")), name, split, T)
    message = str(refused.value)
    assert "\n" not in message and "Traceback" not in message
    return message, sorted(p.name for p in (root / "cache").rglob("*")) if (root / "cache").exists() else []


@pytest.mark.parametrize("name, damage, said", [
    ("n_mnist", lambda root: (root / "Train/1/00002.bin").write_bytes(b"\x01" * 7),
     r"Train/1/00002.bin is not a n_mnist recording .*: its events are cut: it has 7 bytes"),
    ("n_mnist", lambda root: (root / "Train/1/00002.bin").write_bytes(b""), r"Train/1/00002.bin .*: it is empty"),
    ("n_mnist", lambda root: (root / "Train/1/00002.bin").write_bytes(bytes([40, 3, 0, 0, 9])),
     r"00002.bin .*: it holds an event at x or y = 40, outside the 34x34 sensor"),
    ("cifar10_dvs", lambda root: (root / "bird/cifar10_bird_3.aedat").write_bytes(b"#!AER-DAT2.0\r\n\x00\x00\x00"),
     r"cifar10_bird_3.aedat .*: its events are cut"),
    ("cifar10_dvs", lambda root: (root / "bird/cifar10_bird_3.aedat").write_bytes(b"PK\x03\x04zipped"),
     r"cifar10_bird_3.aedat .*: it does not begin with the AEDAT 2.0 header line"),
    ("shd", lambda root: (root / "shd_train.h5").write_bytes(b"not HDF5 at all"),
     r"shd_train.h5 is not a shd recording .*: it is not an HDF5 file"),
    ("shd", lambda root: (root / "shd_train.h5").write_bytes((root / "shd_train.h5").read_bytes()[:3000]),
     r"shd_train.h5 is not a shd recording as its publisher ships it: "),
    ("ssc", lambda root: _without_labels(root / "ssc_train.h5"), r"ssc_train.h5 .*: .*labels"),
    ("dvs128_gesture", lambda root: (root / "DvsGesture/user01_led_labels.csv").write_text("gesture;start\n3;9\n"),
     r"user01_led_labels.csv is not a dvs128_gesture recording .*: "),
    ("dvs128_gesture", lambda root: (root / "DvsGesture/trials_to_train.txt").write_text("user01_led.avi\n"),
     r"trials_to_train.txt .*: it lists 'user01_led.avi', which is not an .aedat file"),
    ("dvs128_gesture", lambda root: (root / "DvsGesture/user01_led.aedat").write_bytes(
        (root / "DvsGesture/user01_led.aedat").read_bytes()[:-5]), r"user01_led.aedat .*: its last event packet is cut"),
    ("n_caltech101", lambda root: _cut(root / "Caltech101/anchor/image_0004.bin", 3),
     r"image_0004.bin is not a n_caltech101 recording .*: its events are cut"),
    ("n_caltech101", lambda root: (root / "Caltech101/ant/image_0002.bin").write_bytes(bytes([250, 3, 0, 0, 9])),
     r"image_0002.bin .*: it holds an event at x = 250, outside the ATIS's 240x180 pixels"),
    ("asl_dvs", lambda root: _cut(root / "b/b_0005.mat", 40), r"b_0005.mat is not a asl_dvs recording as its publisher"),
    ("asl_dvs", lambda root: (root / "c/c_0003.mat").write_bytes(b"MATLAB? no"), r"c_0003.mat .*: it is not a MATLAB file"),
    ("dvs_lip", lambda root: _cut(root / "DVS-Lip/train/action/1.npy", 9), r"DVS-Lip/train/action/1.npy is not a dvs_lip"),
    ("dvs_lip", lambda root: (root / "DVS-Lip/train/hello").mkdir(), r"DVS-Lip/train/hello .*: it is a folder of no word"),
], ids=["nmnist-7-bytes", "nmnist-empty", "nmnist-off-sensor", "cifar10dvs-cut", "cifar10dvs-zip", "shd-not-hdf5",
        "shd-cut", "ssc-no-labels", "gesture-csv-layout", "gesture-trial-list", "gesture-cut", "caltech-cut",
        "caltech-off-sensor", "asl-cut", "asl-not-matlab", "lip-cut", "lip-stray-word"])
def test_a_bad_recording_of_any_format_is_refused_in_one_line_naming_it_and_leaves_no_cache(tmp_path, name, damage,
                                                                                          said):
    WRITERS[name](tmp_path)
    damage(tmp_path)
    message, cached = refusal(name, tmp_path)
    assert re.search(said, message), message
    assert f"get it again from {event_formats.URLS[name]}" in message
    assert cached == []  # no temporary folder, no frames, no lock


def _cut(path, last):
    path.write_bytes(path.read_bytes()[:-last])


def _without_labels(path):
    import h5py

    with h5py.File(path, "a") as file:
        del file["labels"]


def test_a_bad_recording_is_refused_where_the_set_is_first_listed(tmp_path):
    """The builder lists the recordings to tell raw ones from SpikingJelly's frames: a foreign file is refused there."""
    write_dvs128_gesture(tmp_path)
    (tmp_path / "DvsGesture/user02_led_labels.csv").write_text("class,startTime_usec,endTime_usec\n12,5,9\n")
    spec = InputSpec(time_steps=T, shape=(2, 32, 32), num_classes=11)
    with pytest.raises(DataError, match=r"user02_led_labels.csv .*: its rows are not class \(1 to 11\)"):
        neuromorphic.builder("dvs128_gesture")(data_config("dvs128_gesture", tmp_path), spec, "train", 0)
    assert not (tmp_path / ".snnfw-frames").exists()


def test_bad_recordings_are_skipped_with_a_count_when_the_setting_says_so(tmp_path, capfd):
    written = write_nmnist(tmp_path)
    (tmp_path / "Train/0/00001.bin").write_bytes(b"")
    (tmp_path / "Train/2/00003.bin").write_bytes(b"\x01" * 12)
    message, _ = refusal("n_mnist", tmp_path)
    assert message.endswith('or set data.bad_recordings = "skip" to leave out such recordings')
    config = data_config("n_mnist", tmp_path, bad_recordings="skip", augment=["drop_event"])
    spec = InputSpec(time_steps=T, shape=(2, 34, 34), num_classes=10)
    train = neuromorphic.builder("n_mnist")(config, spec, "train", 0)
    assert "n_mnist train: 2 recordings left out as not as their publisher ships them" in capfd.readouterr().err
    kept = [sample for index, sample in enumerate(written["train"]) if index not in (1, 11)]
    assert len(train) == 14 and train.labels.tolist() == [label for _, label in kept]
    expected = ToFrame(sensor_size=(34, 34, 2), n_event_bins=T)(kept[10][0])
    assert np.array_equal(np.asarray(train.frames[10]).reshape(expected.shape), expected)
    again = train.with_events(10, (), {}, seed=0)[0]  # read again from its own recording, not a neighbour's
    assert torch.equal(again, torch.from_numpy(np.asarray(train.frames[10], dtype=np.float32)))
    refused, _ = refusal("n_mnist", tmp_path)  # a run that refuses does not read the cache that skipped
    assert "00001.bin" in refused
