"""How well ``snnfw tune``'s cost model predicts a step on this machine, before and after learning from records.

For each family, world size and strategy below, ``snnfw bench`` runs the candidate RUNS times (each record keeps
the model's uncorrected prediction); the measured step is the median of those runs. Then:

- before learning: the uncorrected prediction against the measurement;
- after learning: leave one candidate out: the corrections are fitted on the records of every other candidate
  and predict the one left out (never its own records);
- tune's pick in each (family, world): the fastest by the left-out predictions, against the fastest measured.

    python benchmark/tune_accuracy.py benchmark/results/tune           # measures (about 30 minutes here)
    python benchmark/tune_accuracy.py benchmark/results/tune --report  # the figures from the records there
    python benchmark/tune_accuracy.py benchmark/results/tune --at 64 512  # predictions for large worlds
    python benchmark/tune_accuracy.py benchmark/results/tune --repredict benchmark/results/now  # today's model
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import attrs

from snnfw.plan import cost_model
from snnfw.tools import tune

CONFIG = "examples/quickstart.toml"
DATA = ["data.batch_size=16", "data.train_samples=128", "data.test_samples=16"]
FAMILIES = {"vgg": ["model.family=cifar10dvs_vgg", "model.flavor=tiny"],
            "spikformer": ["model.family=spikformer", "model.flavor=tiny"]}
CANDIDATES = {  # world -> (name, overrides)
    2: [("dp", ["parallel.strategy=dp"]), ("zero", ["parallel.strategy=zero"]), ("fsdp2", ["parallel.strategy=fsdp2"]),
        ("tp", ["parallel.strategy=tp"]), ("pp", ["parallel.strategy=pp", "pipeline.schedule=1f1b"]),
        ("tsp", ["parallel.strategy=tsp"]),
        # settings tune tries: a neuron backend, memopt's checkpoints, another slice count of tsp's wavefront
        ("dp inductor", ["parallel.strategy=dp", "model.neuron_backend=inductor"]),
        ("dp memopt 1", ["parallel.strategy=dp", "memopt.level=1"]),
        ("tsp 4 slices", ["parallel.strategy=tsp", "tsp.slices=4"])],
    4: [("dp", ["parallel.strategy=dp"]), ("fsdp2", ["parallel.strategy=fsdp2"]),
        ("fsdp2_tp", ["parallel.strategy=fsdp2_tp"]),
        ("pp x dp", ["parallel.strategy=pp", "parallel.mesh={pp = 2, dp = 2}", "pipeline.schedule=1f1b"]),
        ("mesh tp x time", ["parallel.strategy=mesh", "parallel.mesh={tp = 2, time = 2}"])],
}
RUNS = 3


def measure(folder: Path) -> None:
    results = folder / tune.RECORDS
    for world in CANDIDATES:
        tune.cluster_here(folder, world, "cpu", probe_now=True)
    for family, model in FAMILIES.items():
        for world, candidates in CANDIDATES.items():
            for name, overrides in candidates:
                for run in range(RUNS):
                    label = f"accuracy {family} {name} x{world}"
                    command = [sys.executable, "-m", "snnfw", "bench", CONFIG, "--nproc", str(world), "--warmup", "2",
                               "--steps", "5", "--results", str(results), "--label", label,
                               *(a for o in (*model, *DATA, *overrides) for a in ("--set", o))]
                    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                    tail = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:]
                    print(f"{label} run {run + 1}: {tail}", flush=True)


def report(folder: Path) -> None:
    records = [r for r in cost_model.read_records(folder / tune.RECORDS) if r.get("predicted")]
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["label"], []).append(r)
    rows = []
    for label, runs in groups.items():
        others = [r for other, rs in groups.items() if other != label for r in rs]
        corrections = cost_model.fit(others, "cpu")
        parts = {key: statistics.median(r["predicted"][key] for r in runs) for key in ("ms", "compute_ms", "communication_ms")}
        plan = runs[0]["plan"]
        learned = corrections.apply(parts["compute_ms"], parts["communication_ms"], plan["strategy"], tuple(plan["mesh"]))
        rows.append((label, statistics.median(r["step_ms"] for r in runs), parts["ms"], learned))
    print(f"{'candidate':<40} {'measured':>9} {'before':>9} {'err':>7} {'after':>9} {'err':>7}")
    for label, measured, before, after in rows:
        print(f"{label:<40} {measured:>9.1f} {before:>9.1f} {_err(before, measured):>7.1%} {after:>9.1f} "
              f"{_err(after, measured):>7.1%}")
    for when, column in (("before learning", 2), ("after learning (leave one out)", 3)):
        errors = [_err(row[column], row[1]) for row in rows]
        print(f"{when}: median error {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)} candidates")
    for family, world in sorted({(label.split(" ")[1], label.rsplit(" ", 1)[1]) for label, *_ in rows}):
        mine = [row for row in rows if row[0].split(" ")[1] == family and row[0].endswith(world)]
        picked, fastest = min(mine, key=lambda row: row[3]), min(mine, key=lambda row: row[1])
        print(f"{family} {world}: tune picks {picked[0].split(' ', 2)[2]} ({picked[1]:.1f} ms measured), the fastest "
              f"measured is {fastest[0].split(' ', 2)[2]} ({fastest[1]:.1f} ms): {picked[1] / fastest[1] - 1:+.1%}")


def repredict(folder: Path, into: Path) -> None:
    """The records of ``folder`` again in ``into`` with the current model's uncorrected predictions: the same
    measurements, each candidate's config (its explicit keys, as the record keeps them) profiled and dry-run anew
    here over the probe kept in ``folder``."""
    records = cost_model.read_records(folder / tune.RECORDS)
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / tune.PROBE, into / tune.PROBE)
    parts: dict[str, dict] = {}
    lines = []
    for record in records:
        if record["label"] not in parts:
            config = record["config"]
            overrides = [f"{key}={tune._toml(config[section][name])}"
                         for key in config["explicit"] for section, name in [key.split(".")]]
            parts[record["label"]] = tune.predicted_parts(None, overrides, record["nproc"], into / tune.RECORDS)
            print(f"{record['label']}: {parts[record['label']]['ms']:.1f} ms predicted", flush=True)
        lines.append(json.dumps({**record, "predicted": parts[record["label"]]}) + "\n")
    (into / tune.RECORDS).write_text("".join(lines))


def _err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def at_scale(folder: Path, worlds: list[int]) -> None:
    """Predictions for large worlds: this host's profile and corrections, the 4-rank probe's links."""
    from snnfw.config import load_config
    from snnfw.plan.prepare import costed_candidates
    from snnfw.plugin.manager import Plugins

    cluster = cost_model.Cluster.from_dict(json.loads((folder / tune.PROBE).read_text())[next(
        key for key in json.loads((folder / tune.PROBE).read_text()) if key.endswith("/cpu/4"))])
    corrections = cost_model.fit(cost_model.read_records(folder / tune.RECORDS), "cpu")
    plugins = Plugins()
    for world in worlds:
        overrides = [*FAMILIES["vgg"], "data.batch_size=1024", "parallel.strategy=auto"]
        config = load_config(CONFIG, overrides)
        ranked, _, cost = costed_candidates(config, world, plugins, device_memory=float("inf"), threads=1)
        one_rank_a_host = attrs.evolve(cluster, local_ranks=1, cores=1)
        print(f"world {world}, VGG tiny, global batch 1024:")
        for candidate in ranked[:6]:
            terms, memory = tune.step_terms(load_config(CONFIG, [*overrides, *candidate.overrides()]), world, plugins,
                                            candidate, cost)
            prediction = cost_model.predict(terms, one_rank_a_host, corrections)
            print(f"  {tune._name(candidate):<48} {prediction.ms:>9.1f} ms  {memory / 2**20:>8.1f} MB a rank")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--at", type=int, nargs="*")
    parser.add_argument("--repredict", type=Path, metavar="INTO", help="the folder's records predicted anew, into INTO")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.repredict:
        repredict(args.folder, args.repredict)
        report(args.repredict)
    elif args.at:
        at_scale(args.folder, args.at)
    elif args.report:
        report(args.folder)
    else:
        measure(args.folder)
        report(args.folder)


if __name__ == "__main__":
    main()
