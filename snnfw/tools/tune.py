"""``snnfw tune``: the fastest plan for this model here, predicted by :mod:`snnfw.plan.cost_model`, checked by
measurement, learned from every ``snnfw bench`` record.

1. The cluster: the collective probe's links (:mod:`snnfw.tools.probe`), kept in ``probe.json`` beside the
   records and reused for the same host, device and world size.
2. The candidates: every strategy, composed mesh and setting the plugins propose under ``auto``, with the
   model's profile at a rank's threads; the dry run of each (while a third of ``--budget-s`` lasts) counts what
   it holds and the bytes and calls of its collectives by kind. Each again under every combination of the values
   the plugins offer for the keys the user did not set (``train.precision``, ``model.neuron_backend``,
   ``memopt.level``: the hook ``snnfw_tune_settings``), the model profiled under each while half the budget
   lasts. Those whose fullest rank does not fit are dropped.
3. Predictions, with the corrections fitted from the records (``corrections.json``).
4. The most promising are measured (``snnfw bench``, a record each) while ``--budget-s`` lasts; the
   corrections are refitted from all the records and everything predicted again.
5. The winner (the fastest measured, else the fastest predicted whose run did not fail) is written as a config
   file, with a table: candidate, predicted ms, measured ms, memory per rank; the winner's prediction, each figure
   with where it came from; and a last line: how many candidates were measured, and where the winner or one
   predicted faster was not, why and how to have it measured.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path

import attrs

from snnfw.config import load_config, parse_override
from snnfw.errors import ConfigError, PlanError, UserError
from snnfw.plan import cost_model
from snnfw.plan.cost_model import Cluster, Corrections, StepTerms, Traffic
from snnfw.plan.prepare import costed_candidates, tune_settings
from snnfw.plugin.manager import Plugins
from snnfw.rundir import check_writable

RECORDS = "bench.jsonl"
PROBE, CORRECTIONS = cost_model.PROBE, cost_model.CORRECTIONS
WARMUP, STEPS = 2, 4  # a measured candidate's steps
BUDGET_RAN_OUT = "the budget ran out"  # why a candidate has no measurement, the other being that its run failed


@attrs.frozen
class Tuned:
    """One candidate as ``tune`` saw it."""

    name: str
    overrides: tuple[str, ...]
    terms: StepTerms
    memory_bytes: int  # the fullest rank's, by dry run
    estimate_bytes: float  # the strategy's estimate of it, which tells what a setting saves
    predicted_ms: float = 0.0
    measured_ms: float | None = None


def cluster_here(folder: Path, world: int, device_type: str, probe_now: bool) -> Cluster:
    """The probe of ``folder`` for this host, device and world; probed now (and stored) where there is none and
    ``probe_now``; else the stated assumptions."""
    if (stored_cluster := cost_model.stored_cluster(folder, device_type, world)) is not None:
        return stored_cluster
    if not probe_now or world < 2:
        return Cluster.here(device_type, world)
    from snnfw.tools.probe import probe

    cluster = probe(world, device_type)
    path = folder / PROBE
    stored = cost_model.read_kept(path, cost_model.REPROBE)
    stored[cost_model.probe_key(device_type, world)] = cluster.to_dict()
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=2) + "\n")
    return cluster


def step_terms(config, world: int, plugins: Plugins, candidate, cost) -> tuple[StepTerms, int]:
    """The terms of ``config`` (a candidate's) on ``world`` ranks: compute and optimizer from ``candidate``'s
    estimate of the profile ``cost``, the collectives from the dry run; and the bytes its fullest rank holds."""
    from snnfw.tools.dry_run import dry_run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch renaming the tensor collectives the strategies call
        _, footprints = dry_run(config, world, plugins)
    busiest = max(footprints, key=lambda item: item[1].communication)[1]
    fullest = max(footprints, key=lambda item: item[1].total)[1]
    traffic = tuple(Traffic(kind, nbytes, calls) for kind, nbytes, calls in busiest.traffic)
    return _terms(candidate, cost, traffic), fullest.total


def _terms(candidate, cost, traffic: tuple[Traffic, ...]) -> StepTerms:
    """``candidate``'s compute and optimizer from the profile ``cost``, its collectives the dry run's ``traffic``."""
    terms = cost_model.terms_of(candidate.strategy, candidate.estimate, cost, tuple(candidate.mesh))
    return attrs.evolve(terms, traffic=traffic, sources=(*terms.sources[:2], ("traffic", "dry run")))


def predicted_parts(config_path, overrides: list[str], world: int, results: Path) -> dict | None:
    """What a bench record of this config keeps to learn from: the cost model's uncorrected parts (None where the
    config's strategy gives no estimate)."""
    config = load_config(config_path, overrides)
    plugins = Plugins()
    device_type = _device_type(config, world)
    ranked, _, cost = costed_candidates(config, world, plugins)
    if not ranked:
        return None
    terms, _ = step_terms(config, world, plugins, ranked[0], cost)
    cluster = cluster_here(results.parent, world, device_type, probe_now=False)
    return {**cost_model.predict(terms, cluster).parts(), "cluster": cluster.links["all_reduce"].bandwidth.source}


def tune(config_path, world: int, overrides: list[str], budget_s: float, results: Path | None, out: Path,
         measure: int, probe_now: bool = True) -> int:
    """``snnfw tune``: predicts every candidate, measures the best within ``budget_s``, writes the winner to ``out``
    and the bench records to ``results`` (``bench.jsonl`` beside ``out`` where None)."""
    started = time.monotonic()
    check_arguments(world, budget_s, measure)
    check_writable(out, "--out")
    results = results or out.with_name(RECORDS)
    check_writable(results, "--results")
    base = [*overrides, "parallel.strategy=auto"]
    config = load_config(config_path, base)
    if config.parallel.tune_results is not None:
        raise UserError(f"{config_path} sets parallel.tune_results, which auto reads; tune learns from --results and "
                        "writes configs of named strategies, which refuse it: tune a copy without the key")
    device_type = _device_type(config, world)
    folder = results.parent
    # the records and what tune keeps beside them are read first: a damaged file is refused before anything runs
    device = Cluster.here(device_type, world).device
    cost_model.read_corrections(folder / CORRECTIONS, device)
    corrections = cost_model.learned_corrections(results, device)
    cluster = cluster_here(folder, world, device_type, probe_now)  # probe.json read before the links are probed
    plugins = Plugins()
    ranked, _, cost = costed_candidates(config, world, plugins)
    tuned = []
    for index, candidate in enumerate(ranked, start=1):
        if time.monotonic() - started > budget_s / 3 and tuned:
            print(f"\na third of the budget spent: {len(ranked) - index + 1} candidate(s) not dry-run, left out",
                  file=sys.stderr)
            break
        _progress(index, len(ranked), f"dry run of {candidate.assignments}")
        chosen = [*overrides, *candidate.overrides()]
        try:
            terms, memory = step_terms(load_config(config_path, chosen), world, plugins, candidate, cost)
        except ConfigError as err:
            print(f"\n  not a candidate: {candidate.assignments}: {err}", file=sys.stderr)
            continue
        tuned.append(Tuned(_name(candidate), tuple(candidate.overrides()), terms, memory,
                           candidate.estimate.memory_bytes))
    print(file=sys.stderr)
    settings = combinations(tune_settings(config, world, plugins))
    for index, setting in enumerate(settings, start=1):
        if time.monotonic() - started > budget_s / 2:
            print(f"half the budget spent: {len(settings) - index + 1} setting(s) not profiled, from "
                  f"{_described(setting)}", file=sys.stderr)
            break
        _progress(index, len(settings), f"profile under {_described(setting)}")
        tuned += _in_setting(config_path, base, world, plugins, tuned, setting)
    print(file=sys.stderr)
    limit = config_memory(world, device_type)
    tuned = [t for t in tuned if t.memory_bytes <= limit]
    if not tuned:
        raise UserError(f"no candidate fits {world} rank(s) here; see snnfw plan --dry-run")
    tuned = _predicted(tuned, cluster, corrections)
    why_not = {}  # a candidate's name: why it has no measurement
    for index, candidate in enumerate(tuned[:measure], start=1):
        left = budget_s - (time.monotonic() - started)
        if left < 5:
            print(f"budget spent: {len(tuned[:measure]) - index + 1} candidate(s) not measured", file=sys.stderr)
            why_not.update(dict.fromkeys((t.name for t in tuned[index - 1:measure]), BUDGET_RAN_OUT))
            break
        _progress(index, min(measure, len(tuned)), f"measuring {candidate.name} ({left:.0f} s left)")
        step_ms, why = _bench(config_path, world, [*overrides, *candidate.overrides], results, left)
        if step_ms is None:
            why_not[candidate.name] = why
        else:
            tuned[tuned.index(candidate)] = attrs.evolve(candidate, measured_ms=step_ms)
    print(file=sys.stderr)
    if any(t.measured_ms is not None for t in tuned):
        corrections = cost_model.fit(cost_model.read_records(results), cluster.device)
        cost_model.write_corrections(folder / CORRECTIONS, corrections)
        tuned = _predicted(tuned, cluster, corrections)
        winner = min((t for t in tuned if t.measured_ms is not None), key=lambda t: t.measured_ms)
    else:  # the fastest predicted whose run did not fail
        winner = next((t for t in tuned if why_not.get(t.name, BUDGET_RAN_OUT) == BUDGET_RAN_OUT), None)
        if winner is None:
            raise UserError("every candidate failed to run (the errors above); correct what they say and tune again")
    write_config(config_path, [*overrides, *winner.overrides], out, winner)
    print("\n".join(table(tuned, winner, corrections)))
    print(f"\n{winner.name}'s prediction, each figure with where it came from:")
    print("\n".join(f"  {line}" for line in cost_model.predict(winner.terms, cluster, corrections).lines))
    print(verdict(tuned, winner, out, why_not, budget_s, measure))
    return 0


def verdict(tuned: list[Tuned], winner: Tuned, out: Path, why_not: dict[str, str], budget_s: float,
            measure: int) -> str:
    """tune's last line: the config written, how many candidates were measured, and where the pick or a candidate
    predicted faster than it (than its measured step, where it has one) has no measurement, why and how to have it
    measured."""
    def unmeasured(candidate: Tuned) -> str:
        why = why_not.get(candidate.name, f"--measure is {measure}; raise it to measure it")
        return f"{why}; give tune more --budget-s (it had {budget_s:g}) to measure it" if why == BUDGET_RAN_OUT else why

    count = f"{sum(t.measured_ms is not None for t in tuned)} of {len(tuned)} candidates measured"
    if winner.measured_ms is not None:
        line = f"wrote {out}: {winner.name}, the fastest measured ({winner.measured_ms:.1f} ms a step; {count})"
    else:
        line = (f"wrote {out}: {winner.name}, the fastest predicted ({winner.predicted_ms:.1f} ms a step), not "
                f"measured ({count}): {unmeasured(winner)}")
    step_ms = winner.predicted_ms if winner.measured_ms is None else winner.measured_ms
    faster = [t for t in tuned if t.measured_ms is None and t.predicted_ms < step_ms]
    if faster:
        more = f" (and {len(faster) - 1} more)" if len(faster) > 1 else ""
        line += (f"; {faster[0].name} is predicted faster ({faster[0].predicted_ms:.1f} ms){more} but was not "
                 f"measured: {unmeasured(faster[0])}")
    return line


def check_arguments(world: int, budget_s: float, measure: int) -> None:
    """Refuses the numbers ``tune`` cannot take, before it probes or profiles anything."""
    if world < 1:
        raise UserError(f"--world-size counts the ranks, 1 or more; got {world}")
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise UserError(f"--budget-s is the seconds tune may take, a finite number above 0; got {budget_s:g} (the "
                        "default is 300)")
    if measure < 0:
        raise UserError(f"--measure counts the candidates to measure, 0 or more; got {measure}")


def combinations(offered: dict[str, tuple]) -> list[tuple[tuple[str, object], ...]]:
    """Every combination of the ``offered`` values, each key at one of its values or the config's own, fewest
    changed keys first: ``(("model.neuron_backend", "inductor"),), ...``."""
    axes = [[None, *((key, value) for value in values)] for key, values in offered.items()]
    chosen = [tuple(pair for pair in combination if pair is not None) for combination in itertools.product(*axes)]
    return sorted((c for c in chosen if c), key=len)


def _described(setting) -> str:
    return ", ".join(f"{key} = {value!r}" for key, value in setting)


def _in_setting(config_path, base: list[str], world: int, plugins: Plugins, tuned: list[Tuned], setting) -> list[Tuned]:
    """The dry-run candidates ``tuned`` again under ``setting`` (config values, :func:`combinations`): compute and
    optimizer from a profile of the model under it, the collectives as dry-run; memory as dry-run, less what the
    estimates under the setting hold less (the activations a lower precision or memopt's recomputation saves)."""
    overrides = [f"{key}={value}" for key, value in setting]
    try:
        ranked, _, cost = costed_candidates(load_config(config_path, [*base, *overrides]), world, plugins)
    except (ConfigError, PlanError) as err:
        print(f"\n  not a setting here: {_described(setting)}: {err}", file=sys.stderr)
        return []
    known = {t.overrides: t for t in tuned}
    again = []
    for candidate in ranked:
        if (plain := known.get(tuple(candidate.overrides()))) is not None:
            saved = plain.estimate_bytes - candidate.estimate.memory_bytes
            name = plain.name + "".join(f", {key}={value}" for key, value in setting)
            again.append(Tuned(name, (*plain.overrides, *overrides), _terms(candidate, cost, plain.terms.traffic),
                               round(plain.memory_bytes - saved), candidate.estimate.memory_bytes))
    return again


def _device_type(config, world: int) -> str:
    from snnfw.plan.layout import Topology

    return Topology.detect(world, config.parallel.device, backend=config.parallel.backend).device_type


def config_memory(world: int, device_type: str) -> float:
    from snnfw.plan.estimate import device_memory_bytes

    return device_memory_bytes(device_type, world)


def _predicted(tuned: list[Tuned], cluster: Cluster, corrections: Corrections) -> list[Tuned]:
    """``tuned`` predicted anew, fastest first."""
    again = [attrs.evolve(t, predicted_ms=cost_model.predict(t.terms, cluster, corrections).ms) for t in tuned]
    return sorted(again, key=lambda t: t.predicted_ms)


def _bench(config_path, world: int, overrides: list[str], results: Path, left_s: float) -> tuple[float | None, str]:
    """``(median step ms, "")`` of a candidate by ``snnfw bench`` (its record appended to ``results``), in a process
    of its own that the budget ends; ``(None, why)`` where there is no measurement."""
    command = [sys.executable, "-m", "snnfw", "bench", str(config_path), "--nproc", str(world), "--warmup", str(WARMUP),
               "--steps", str(STEPS), "--results", str(results), "--label", "tune",
               *(arg for override in overrides for arg in ("--set", override))]
    before = len(cost_model.read_records(results)) if results.exists() else 0
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        _, errors = process.communicate(timeout=left_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        print(f"\n  stopped: {BUDGET_RAN_OUT}", file=sys.stderr)
        return None, BUDGET_RAN_OUT
    if process.returncode:
        said = errors.strip().splitlines()[-1] if errors.strip() else f"exit status {process.returncode}"
        print(f"\n  failed: {said}", file=sys.stderr)
        return None, f"its run failed ({said})"
    records = cost_model.read_records(results)
    return (records[-1]["step_ms"], "") if len(records) > before else (None, "its run wrote no record")


def _name(candidate) -> str:
    mesh = " x ".join(f"{d}={n}" for d, n in candidate.mesh.items())
    settings = "".join(f", {key.split('.')[-1]}={value}" for key, value in candidate.settings)
    return f"{candidate.name} ({mesh}{settings})"


def _progress(done: int, total: int, what: str) -> None:
    width = 20
    filled = round(width * done / max(total, 1))
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:70]:<70}", end="", file=sys.stderr,
          flush=True)


def table(tuned: list[Tuned], winner: Tuned, corrections: Corrections) -> list[str]:
    width = max(44, *(len(t.name) for t in tuned))
    lines = [f"predictions: {corrections.source}",
             f"{'candidate':<{width}} {'predicted ms':>12} {'measured ms':>12} {'MB per rank':>12}"]
    for t in tuned:
        measured = f"{t.measured_ms:.1f}" if t.measured_ms is not None else "-"
        mark = "  <- chosen" if t is winner else ""
        lines.append(f"{t.name:<{width}} {t.predicted_ms:>12.1f} {measured:>12} {t.memory_bytes / 2**20:>12.1f}{mark}")
    return lines


def write_config(config_path, overrides: list[str], out: Path, winner: Tuned) -> None:
    """The user's config with the winner's keys, as TOML; refuses to write one that does not load as the same."""
    data = tomllib.loads(Path(config_path).read_text(encoding="utf-8")) if config_path else {}
    for text in overrides:
        section, name, value = parse_override(text)
        data.setdefault(section, {})[name] = value
    head = (f"# snnfw tune's pick: {winner.name}, predicted {winner.predicted_ms:.1f} ms a step"
            + (f", measured {winner.measured_ms:.1f}" if winner.measured_ms is not None else "") + "\n")
    text = head + "".join(f"\n[{section}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in table.items()
                                                        if value is not None)
                          for section, table in data.items())
    out.write_text(text, encoding="utf-8")
    if load_config(out).to_dict() != load_config(config_path, overrides).to_dict():
        raise UserError(f"{out} does not load as the tuned config; pass the winner's keys with --set instead: "
                        f"{' '.join(overrides)}")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items() if v is not None) + "}"
    raise UserError(f"snnfw tune cannot write {value!r} as TOML")
