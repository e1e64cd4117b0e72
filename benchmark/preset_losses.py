"""The float64 losses of the preset strategies on the VGG tiny family (the guarantee's cases), as JSON, to compare two
releases: run it under each tree's interpreter and diff the files.

    python benchmark/preset_losses.py new.json 10
    /path/to/old/venv/bin/python benchmark/preset_losses.py old.json 10
"""

import json
import sys

from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.equivalence import CASES, case_config

PRESETS = ("dp", "zero", "fsdp2", "hsdp", "tp", "fsdp2_tp", "pp-1f1b", "pp-x-dp", "tsp", "dp-x-tsp", "fsdp2-x-tsp")


def main() -> None:
    out_path, steps = sys.argv[1], int(sys.argv[2])
    losses = {"none": run_training(case_config("cifar10dvs_vgg", None, "float64", steps))["losses"]}
    for case in CASES:
        if case.name in PRESETS:
            config = case_config("cifar10dvs_vgg", case, "float64", steps)
            losses[case.name] = run_on_ranks(config, case.ranks, timeout_s=900)[0]["losses"]
            print(case.name, flush=True)
    with open(out_path, "w") as out:
        json.dump(losses, out)


if __name__ == "__main__":
    main()
