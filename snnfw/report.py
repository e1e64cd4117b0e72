"""``snnfw bench --report``: a table and a chart from a benchmark results file.

For every configuration the latest record is shown; where the same model,
batch and world size also has a plain PyTorch baseline record, the table gives
the step-time ratio against it (1.00 = no overhead).
"""

from __future__ import annotations

import json
from pathlib import Path

from snnfw.errors import UserError


def _latest(results: Path) -> list[dict]:
    if not results.exists():
        raise UserError(f"no benchmark results at {results}; run snnfw bench CONFIG first")
    from snnfw.bench import config_key

    latest = {}
    for line in results.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            latest[config_key(record)] = record
    return list(latest.values())


def _workload(record: dict) -> tuple:
    model = record["config"]["model"]
    return (model["family"], model["flavor"], model["time_steps"], record["global_batch"], record["nproc"])


def table(records: list[dict]) -> str:
    """A markdown table of step time, throughput and peak memory, with the ratio to the baseline."""
    baselines = {_workload(r): r for r in records if r["plan"]["strategy"].startswith("baseline")}
    lines = [
        "| model | strategy | ranks | global batch | step ms | samples/s | per-device samples/s | peak MB per rank | vs plain PyTorch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(records, key=lambda r: (_workload(r)[:2], r["nproc"], r["plan"]["strategy"])):
        family, flavor, steps, batch, nproc = _workload(r)
        base = baselines.get(_workload(r))
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base and base is not r else ""
        peaks = " / ".join(f"{p:.0f}" for p in r["peak_mem_mb_per_rank"])
        label = f" ({r['label']})" if r.get("label") else ""
        lines.append(
            f"| {family}/{flavor} T={steps} | {r['plan']['strategy']}{label} | {nproc} | {batch} | {r['step_ms']:.1f} | "
            f"{r['global_samples_per_s']:.1f} | {r['per_device_samples_per_s']:.1f} | {peaks} | {ratio} |"
        )
    return "\n".join(lines)


def chart(records: list[dict], path: Path) -> None:
    """Bars of global throughput and largest per-rank peak memory, one group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({_workload(r)[:2] for r in records})
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        mine = sorted((r for r in records if _workload(r)[:2] == model), key=lambda r: (r["nproc"], r["plan"]["strategy"]))
        names = [f"{r['plan']['strategy']}\nx{r['nproc']}" for r in mine]
        row[0].bar(names, [r["global_samples_per_s"] for r in mine], color="tab:blue")
        row[0].set_title(f"{'/'.join(model)}: global samples/s")
        row[1].bar(names, [r["peak_mem_mb"] for r in mine], color="tab:orange")
        row[1].set_title(f"{'/'.join(model)}: peak MB per rank (largest)")
        for ax in row:
            ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(results: Path, chart_path: Path) -> int:
    records = _latest(results)
    print(table(records))
    chart(records, chart_path)
    print(f"\nchart: {chart_path}")
    return 0
