"""``snnfw bench --report``: a table and a chart from a benchmark results file.

Records of the same configuration are repeated runs: the table shows their
median step time (with the count) and the largest peak memory. Where the same
model, batch and world size also has a plain PyTorch baseline, the table gives
the overhead ratio (1.00 = none): each run is divided by the baseline run
nearest to it in the file, and the median of those ratios is shown. On a
machine whose speed drifts, alternate framework and baseline runs and repeat
them (``benchmark/run_all.sh`` does), so that each pair shares its conditions.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path

from snnfw.errors import UserError
from snnfw.plugin.manager import Plugins


def _grouped(results: Path) -> list[dict]:
    """The records of ``results``, grouped by configuration."""
    if not results.exists():
        raise UserError(f"no benchmark results at {results}; run snnfw bench CONFIG first")
    from snnfw.tools.bench import config_key

    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return grouped(records, config_key)


def grouped(records: list[dict], key) -> list[dict]:
    """One record per configuration (``key(record)``): the latest, with the median step time over all
    its runs, the top peaks, and ``run_ms``, the (position in ``records``, step ms) of each run."""
    runs: dict[str, list[tuple[int, dict]]] = {}
    for order, record in enumerate(records):
        runs.setdefault(key(record), []).append((order, record))
    merged = []
    for group in runs.values():
        last = group[-1][1]
        step_ms = statistics.median(r["step_ms"] for _, r in group)
        peaks = [max(r["peak_mem_mb_per_rank"][i] for _, r in group) for i in range(last["nproc"])]
        merged.append({
            **last, "runs": len(group), "step_ms": step_ms, "peak_mem_mb_per_rank": peaks, "peak_mem_mb": max(peaks),
            "run_ms": [(order, r["step_ms"]) for order, r in group],
            "global_samples_per_s": last["global_batch"] / step_ms * 1e3,
            "per_device_samples_per_s": last["global_batch"] / step_ms * 1e3 / last["nproc"],
        })
    return merged


def strategy_label(record: dict) -> str:
    """The strategy (or the preset it was asked by), with what the plan's strategies add (a pipeline's schedule, a composed mesh's shape), a
    neuron backend other than torch, and the record's label."""
    plan, plugins = record["plan"], _plugins()
    words = [plan.get("preset") or plan["strategy"]]
    for name in (plan["strategy"], *plan.get("strategies", ())):
        if name in plugins.strategies.names() and (label := plugins.strategy(name).label(record["config"], plan)):
            words.append(label)
    if (backend := record["config"]["model"].get("neuron_backend", "torch")) != "torch":
        words.append(f"+{backend} neurons")
    return " ".join(words) + (f" ({record['label']})" if record.get("label") else "")


@functools.cache
def _plugins() -> Plugins:
    return Plugins()


def _workload(record: dict) -> tuple:
    model, precision = record["config"]["model"], record["config"]["train"].get("precision", "fp32")
    return (model["family"], model["flavor"], model["time_steps"], precision, record["global_batch"], record["nproc"])


def _panel(record: dict) -> tuple:
    """One chart row: family, flavor, precision."""
    family, flavor, _, precision, *_ = _workload(record)
    return family, flavor, precision


def overhead(runs: list[tuple[int, float]], baseline_runs: list[tuple[int, float]]) -> float:
    """The median over ``runs`` of step ms divided by that of the nearest baseline run (file order)."""

    def nearest(order: int) -> float:
        return min(baseline_runs, key=lambda run: (abs(run[0] - order), run[0]))[1]

    return statistics.median(ms / nearest(order) for order, ms in runs)


def table(records: list[dict]) -> str:
    """A markdown table of step time, throughput and peak memory, with the overhead against the baseline."""
    baselines = {_workload(r): r for r in records if r["plan"]["strategy"].startswith("baseline")}
    lines = [
        "| model | precision | strategy | ranks | global batch | runs | step ms (median) | samples/s | per-device samples/s | peak MB per rank | vs plain PyTorch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(records, key=lambda r: (_workload(r)[:4], r["nproc"], strategy_label(r))):
        family, flavor, steps, precision, batch, nproc = _workload(r)
        base = baselines.get(_workload(r))
        ratio = f"{overhead(r['run_ms'], base['run_ms']):.2f}" if base and base is not r else ""
        peaks = " / ".join(f"{p:.0f}" for p in r["peak_mem_mb_per_rank"])
        lines.append(
            f"| {family}/{flavor} T={steps} | {precision} | {strategy_label(r)} | {nproc} | {batch} | {r['runs']} | {r['step_ms']:.1f} | "
            f"{r['global_samples_per_s']:.1f} | {r['per_device_samples_per_s']:.1f} | {peaks} | {ratio} |"
        )
    return "\n".join(lines)


def chart(records: list[dict], path: Path) -> None:
    """Bars of global throughput and largest per-rank peak memory, one group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({_panel(r) for r in records})
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        mine = sorted((r for r in records if _panel(r) == model), key=lambda r: (r["nproc"], strategy_label(r)))
        names = [f"{strategy_label(r)}\nx{r['nproc']}" for r in mine]
        row[0].bar(names, [r["global_samples_per_s"] for r in mine], color="tab:blue")
        row[0].set_title(f"{'/'.join(model)}: global samples/s")
        row[1].bar(names, [r["peak_mem_mb"] for r in mine], color="tab:orange")
        row[1].set_title(f"{'/'.join(model)}: peak MB per rank (largest)")
        for ax in row:
            ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


MARKERS = ("<!-- bench-table -->", "<!-- /bench-table -->")


def write_into(path: Path, text: str) -> None:
    """Replaces what lies between the two :data:`MARKERS` lines of ``path`` with ``text``."""
    start, end = MARKERS
    document = path.read_text()
    if start not in document or end not in document:
        raise UserError(f"{path} has no {start} ... {end} section to write the table into; add the two lines first")
    head, rest = document.split(start, 1)
    path.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


def report(results: Path, chart_path: Path, into: Path | None = None) -> int:
    records = _grouped(results)
    text = table(records)
    print(text)
    chart(records, chart_path)
    print(f"\nchart: {chart_path}")
    if into is not None:
        write_into(into, text)
        print(f"table written into {into}")
    return 0
