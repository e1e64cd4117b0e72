"""The CPU cost of the static-image recipe per training sample, beside the plain test view, in one process.

    python benchmark/augment.py [--side 224] [--samples 32] [--rounds 3]

Writes ``--samples`` JPEGs of ImageNet's typical 500x375 into a temporary image folder, then times
:class:`snnfw.data.augment.Augmented` over the same keys for each setting (alternating the settings each round,
so the machine's drift spreads over all): the test view (decode, scale, centre crop), the resized crop and flip,
then RandAugment (two operations at bin 27), then mixup or cutmix (which reads and transforms each sample's
partner too). Prints milliseconds per sample (the median round) and each setting's ratio to the test view.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from snnfw.config import build_config
from snnfw.data.augment import Augmented, augment_options
from snnfw.data.batches import InputSpec
from snnfw.testing.layouts import write_image_folder
from snnfw_plugins.datasets.images import build_image_folder

SETTINGS = {
    "test view": [],
    "resized_crop, hflip": ["resized_crop", "hflip"],
    "+ randaugment": ["resized_crop", "hflip", "randaugment"],
    "+ mixup, cutmix": ["resized_crop", "hflip", "randaugment", "mixup", "cutmix"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in one data-loading worker
    with tempfile.TemporaryDirectory() as folder:
        root = write_image_folder(Path(folder), classes=["a", "b"], per_class=args.samples // 2, sizes=((375, 500),))
        spec = InputSpec(4, (3, args.side, args.side), 1000)
        dataset = build_image_folder(build_config({"data": {"root": str(root)}}).data, spec, "train", 0)
        sets = {}
        for name, names in SETTINGS.items():
            data = build_config({"data": {"augment": names, "randaugment_magnitude": 27} if names else {}}).data
            sets[name] = Augmented(dataset, data.augment, augment_options(data), seed=0, classes=1000)
        times = {name: [] for name in SETTINGS}
        for round_ in range(args.rounds):
            for name in (list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))):
                started = time.perf_counter()
                for key in range(len(dataset)):
                    sets[name][key]
                times[name].append((time.perf_counter() - started) * 1e3 / len(dataset))
    base = statistics.median(times["test view"])
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"{name:22s} {median:7.1f} ms a sample  x{median / base:.2f}  (rounds: {', '.join(f'{t:.1f}' for t in measured)})")


if __name__ == "__main__":
    main()
