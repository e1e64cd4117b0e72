"""How far float32 rounding carries each strategy from ``none`` over 20 Adam steps.

    python benchmark/drift.py [--steps 20] [--families cifar10dvs_vgg,spikformer,spiking_mlp] [--out drift.json]

Runs every case of :mod:`snnfw.testing.equivalence` in float32 on local CPU ranks
beside ``none`` with the same microbatches, and prints the largest relative
loss difference per strategy and family as a Markdown table (in float64 the
same cases agree within 1e-9: tests/test_guarantee.py). The out-of-tree
``spiking_mlp`` family is pip-installed into a temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.equivalence import CASES, FAMILIES, case_config, max_relative_difference, reference_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "spiking_mlp_plugin"


def install_example(target: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", target, str(EXAMPLE)], check=True, timeout=300)
    sys.path.insert(0, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default="drift.json")
    args = parser.parse_args()
    families = args.families.split(",")
    with tempfile.TemporaryDirectory() as site:
        if "spiking_mlp" in families:
            install_example(site)
        drift: dict[str, dict[str, float]] = {case.name: {} for case in CASES}
        references: dict[tuple[str, int], list[float]] = {}
        for family in families:
            for case in CASES:
                key = (family, case.reference_microbatches)
                if key not in references:
                    references[key] = run_training(reference_config(family, key[1], "float32", args.steps))["losses"]
                losses = run_on_ranks(case_config(family, case, "float32", args.steps), case.ranks, timeout_s=600)[0]["losses"]
                drift[case.name][family] = max_relative_difference(references[key], losses)
                print(f"{family} {case.name}: {drift[case.name][family]:.2e}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "drift": drift}, indent=2) + "\n")
    print(f"| strategy | {' | '.join(families)} |\n| --- |{' --- |' * len(families)}")
    for name, row in drift.items():
        print(f"| {name} | {' | '.join(f'{row[f]:.1e}' for f in families)} |")


if __name__ == "__main__":
    main()
