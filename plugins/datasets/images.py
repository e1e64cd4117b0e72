"""Static images, direct-encoded (the image itself at every time step, as spiking transformers take it).

``cifar100``: ``data.root`` holds CIFAR-100 as published, the python version (``cifar-100-python``: the
pickles ``train`` and ``test``) or the binary version (``cifar-100-binary``: ``train.bin`` and ``test.bin``,
records of a coarse and a fine label byte and 3072 pixel bytes); the 100 fine labels are the classes.

``image_folder``: ImageNet's layout, ``data.root/train/<class>/<image>`` and ``data.root/val/<class>/<image>``,
classes numbered in the sorted order of their folder names (torchvision's ``ImageFolder``), images read with
PIL as RGB. A file that is no image by its name (``.jpg``, ``.jpeg``, ``.png``, ``.ppm``, ``.bmp``, ``.pgm``,
``.tif``, ``.tiff``, ``.webp``), a class folder without images or a split of one class is refused when the
folder is listed, an image PIL cannot read when it is read.

Both give :class:`snnfw.data.images.DirectEncoded` sets: the test view is the image scaled to cover the model's
input and its centre cropped; ``data.augment``'s transforms, ``resized_crop`` and ``randaugment`` included, work
on the image as stored before it is repeated over the time steps.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from snnfw import hookimpl
from snnfw.api import DataError, DatasetSpec, DirectEncoded
from snnfw_plugins.datasets.events import RAW_ONLY
from snnfw_plugins.datasets.neuromorphic import ON_DISK_UNREAD

PIXELS = 3 * 32 * 32
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FOLDERS = {"train": "train", "test": "val"}
UNPICKLED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
             ("numpy", "ndarray"), ("numpy", "dtype")}  # all that CIFAR-100's pickles hold beside plain values


class Pixels(DirectEncoded):
    """Images held as ``uint8`` rows of 3072 red, green and blue 32x32 pixels, with their labels."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray, spec):
        super().__init__(spec)
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def raw(self, index: int):
        import torch

        return torch.from_numpy(self.pixels[index].astype(np.float32) / 255).view(3, 32, 32), int(self.labels[index])


class Files(DirectEncoded):
    """Image files with their labels, read with PIL when a sample is asked for."""

    def __init__(self, files: list[tuple[Path, int]], spec):
        super().__init__(spec)
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def raw(self, index: int):
        import torch
        from PIL import Image, UnidentifiedImageError

        path, label = self.files[index]
        try:
            with Image.open(path) as opened:
                image = np.asarray(opened.convert("RGB"))
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as err:
            raise DataError(f"{path} cannot be read as an image ({err}); replace it with the image, or remove it") from None
        return torch.from_numpy(image.astype(np.float32) / 255).permute(2, 0, 1), label


class _NumpyOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in UNPICKLED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which CIFAR-100's pickles do not")
        return super().find_class(module, name)


def _pickled(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as file:
            batch = _NumpyOnly(file, encoding="bytes").load()
        pixels, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"fine_labels"])
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, IndexError) as err:
        raise DataError(f"{path} is not a CIFAR-100 python batch ({err or type(err).__name__}); use the files of "
                        "cifar-100-python.tar.gz as published") from None
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != PIXELS or labels.shape != (len(pixels),):
        raise DataError(f"{path} is not a CIFAR-100 python batch: its data are {pixels.dtype} {list(pixels.shape)} with "
                        f"{labels.size} labels, not uint8 rows of {PIXELS} pixels with one label each")
    return pixels, labels


def _binary(path: Path) -> tuple[np.ndarray, np.ndarray]:
    record = 2 + PIXELS
    size = path.stat().st_size
    if size == 0 or size % record:
        raise DataError(f"{path} is not a CIFAR-100 binary batch: {size} bytes is no multiple of {record}-byte records")
    records = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, record)
    return records[:, 2:], records[:, 1]


def _check_model(name: str, classes: int, spec) -> None:
    if spec.shape[0] != 3:
        raise DataError(f"data set {name} has RGB images, and the model takes {spec.shape[0]} channels; choose a model "
                        "that takes 3 (a model of your own: model.input_shape = [3, H, W])")
    if spec.num_classes < classes:
        raise DataError(f"data set {name} has {classes} classes, and the model has {spec.num_classes}; "
                        f"set model.num_classes = {classes}")


def build_cifar100(config, spec, split, seed):
    if config.root is None:
        raise DataError("data set cifar100 reads CIFAR-100 from data.root; set it to the folder of its python or binary version")
    root = Path(config.root)
    binary, pickled = root / f"{split}.bin", root / split
    if binary.is_file():
        path, (pixels, labels) = binary, _binary(binary)
    elif pickled.is_file():
        path, (pixels, labels) = pickled, _pickled(pickled)
    else:
        raise DataError(f"neither {pickled} nor {binary} exists: data set cifar100 reads CIFAR-100's python version "
                        "(train, test) or binary version (train.bin, test.bin) from data.root")
    if labels.size and int(labels.max()) >= 100:
        raise DataError(f"{path} has label {int(labels.max())}, and CIFAR-100 has 100 classes; use the files as published")
    _check_model("cifar100", 100, spec)
    return Pixels(pixels, labels, spec)


def class_names(root: Path, split: str) -> list[str]:
    folder = root / FOLDERS[split]
    if not folder.is_dir():
        raise DataError(f"{folder} is no folder: data set image_folder reads data.root/train/<class>/ and "
                        "data.root/val/<class>/ (ImageNet's layout)")
    if not (classes := sorted(p.name for p in folder.iterdir() if p.is_dir())):
        raise DataError(f"{folder} has no class folders: put each class's images in data.root/{FOLDERS[split]}/<class>/")
    if len(classes) == 1:  # every prediction right, whatever the model learnt
        raise DataError(f"{folder} has one class folder, {classes[0]}, and a classifier needs two or more; add a folder "
                        "of images for each other class")
    return classes


def image_files(root: Path, split: str) -> tuple[list[tuple[Path, int]], list[str]]:
    """The split's ``(file, class index)`` pairs and class names; refuses a file that is no image and an empty class."""
    folder, classes = root / FOLDERS[split], class_names(root, split)
    files = []
    for label, name in enumerate(classes):
        images = sorted(p for p in (folder / name).rglob("*") if p.is_file())
        if stray := next((p for p in images if p.suffix.lower() not in EXTENSIONS), None):
            raise DataError(f"{stray} is no image ({', '.join(EXTENSIONS)}); remove it from the class folders")
        if not images:
            raise DataError(f"class folder {folder / name} has no images; add them, or remove the folder from both splits")
        files += [(p, label) for p in images]
    return files, classes


def build_image_folder(config, spec, split, seed):
    if config.root is None:
        raise DataError("data set image_folder reads images from data.root; set it to the folder holding train/ and val/")
    root = Path(config.root)
    files, classes = image_files(root, split)
    if split == "test" and (train := class_names(root, "train")) != classes:
        differ = sorted(set(train) ^ set(classes))
        raise DataError(f"{root / 'train'} and {root / 'val'} hold different classes ({', '.join(differ[:3])} in only one); "
                        "give both splits the same class folders")
    _check_model("image_folder", len(classes), spec)
    return Files(files, spec)


@hookimpl
def snnfw_register_datasets(register):
    unread = (*ON_DISK_UNREAD, *RAW_ONLY)
    register("cifar100", DatasetSpec(build_cifar100, "CIFAR-100 images, direct-encoded", unread, classes=100,
                                     frame_shape=(3, 32, 32), images=True), "python or binary batches in data.root")
    register("image_folder", DatasetSpec(build_image_folder, "images in class folders, direct-encoded", unread,
                                         images=True), "data.root/train/<class>/, data.root/val/<class>/ (ImageNet's)")
