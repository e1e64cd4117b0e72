"""``snnfw tune`` end to end on 2 CPU ranks: it keeps its budget, measures through bench, writes its pick; and
refuses what it cannot take in one line before it profiles or starts a rank."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snnfw.cli import main
from snnfw.config import load_config
from snnfw.plan import cost_model
from snnfw.tools import tune

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
BUDGET_S = 60


def test_tune_stops_within_its_budget_and_writes_the_fastest_measured_as_a_config(tmp_path):
    """In a folder of its own: the records, and what tune learns from them, go beside --out, nothing into the
    folder it runs in."""
    work, out = tmp_path / "work", tmp_path / "out" / "tuned.toml"
    work.mkdir()
    cmd = [sys.executable, "-m", "snnfw", "tune", str(QUICKSTART), "--world-size", "2", "--budget-s", str(BUDGET_S),
           "--measure", "12", "--no-probe", "--out", str(out),
           "--set", "data.batch_size=8", "--set", "data.train_samples=64", "--set", "data.test_samples=16",
           # the inductor backend, predicted fastest, compiles for longer than this budget leaves to measure it
           "--set", "model.neuron_backend=torch"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=BUDGET_S + 240)
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert wall < BUDGET_S + 45, wall  # the budget, and the interpreter's start and the table's print around it
    assert "budget spent" in done.stderr or "stopped: the budget ran out" in done.stderr, done.stderr[-2000:]
    table, explained = done.stdout.split("\n\n", 1)
    rows, chosen = table_rows(table)
    measured = {name: ms for name, _, ms in rows if ms is not None}
    assert measured and len(measured) < len(rows), done.stdout  # some measured before the budget ran out, not all
    fastest = min(measured, key=measured.get)
    assert chosen == fastest, done.stdout
    assert explained.startswith(f"{fastest}'s prediction, each figure with where it came from"), explained
    assert "(profile" in explained and "(dry run)" in explained, explained
    assert explained.splitlines()[-1].startswith(
        f"wrote {out}: {fastest}, the fastest measured ({measured[fastest]:.1f} ms a step; {len(measured)} of "
        f"{len(rows)} candidates measured)"), explained
    tuned = load_config(out)
    assert tuned.parallel.strategy == fastest.split()[0]
    assert tuned.data.batch_size == 8  # the user's own keys kept
    records = cost_model.read_records(out.parent / tune.RECORDS)
    assert len(records) >= len(measured)
    assert all(record["predicted"]["ms"] > 0 for record in records), records
    assert (out.parent / tune.CORRECTIONS).is_file() and not list(work.iterdir())


def table_rows(table: str) -> tuple[list[tuple[str, float, float | None]], str]:
    """The rows of tune's table (below its two heads), each (candidate, predicted ms, measured ms or None), and the
    chosen candidate."""
    rows, chosen = [], None
    for line in table.splitlines()[2:]:
        name, predicted, measured, _ = line.removesuffix("  <- chosen").rsplit(maxsplit=3)
        rows.append((name, float(predicted), None if measured == "-" else float(measured)))
        chosen = name if line.endswith("<- chosen") else chosen
    return rows, chosen


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test where tune probes the links or profiles the model: a refusal comes before both."""
    from snnfw.tools import probe

    def started(*args, **kwargs):
        raise AssertionError("tune went on to probe or profile")

    monkeypatch.setattr(probe, "probe", started)
    monkeypatch.setattr(tune, "costed_candidates", started)


def refusal(capsys, *args) -> str:
    """The one line on stderr with which the CLI refuses ``args`` (exit status 2)."""
    status = main([str(arg) for arg in args])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("snnfw: error: "), err
    return err.strip()


def tune_args(tmp_path, *args):
    return ["tune", QUICKSTART, "--world-size", 2, "--no-probe", "--out", tmp_path / "tuned.toml", "--results",
            tmp_path / "bench.jsonl", *args]


@pytest.mark.parametrize("ranks", [0, -2])
def test_a_world_of_no_ranks_is_refused_by_tune_and_plan(ranks, tmp_path, capsys, nothing_starts):
    said = f"--world-size counts the ranks, 1 or more; got {ranks}"
    assert said in refusal(capsys, "tune", QUICKSTART, "--world-size", ranks, "--out", tmp_path / "tuned.toml")
    for strategy in ("dp", "auto"):  # dp's refusal named --nproc, auto divided by zero
        assert said in refusal(capsys, "plan", QUICKSTART, "--world-size", ranks, "--set",
                               f"parallel.strategy={strategy}")


@pytest.mark.parametrize("budget", ["nan", "inf", "0", "-5"])
def test_a_budget_that_is_no_finite_time_is_refused(budget, tmp_path, capsys, nothing_starts):
    said = refusal(capsys, *tune_args(tmp_path, "--budget-s", budget))
    assert f"--budget-s is the seconds tune may take, a finite number above 0; got {float(budget):g}" in said


@pytest.mark.parametrize("name, text, said", [
    ("bench.jsonl", None, "--results {path} is a folder; name the file to write in it"),
    ("bench.jsonl", '{"step_ms": 1.0, "devi\n', "{path} line 1 is not a JSON record (Unterminated string"),
    ("bench.jsonl", '{"step_ms": 1.0}\n', "{path} line 1 is not an snnfw bench record (it lacks step_ms, device,"),
    ("corrections.json", "{oops", "{path} is not snnfw's corrections file (Expecting property name"),
    ("corrections.json", '{"cpu": {"records": "x", "scale": 2}}', "{path} is not snnfw's corrections file ("),
    ("probe.json", "[1, 2]", "{path} is not snnfw's probe file (it holds no JSON object); delete it, and snnfw tune "
                             "probes the links again"),
], ids=["results-folder", "damaged-record", "foreign-record", "damaged-corrections", "foreign-corrections", "probe"])
def test_damaged_or_unwritable_results_are_refused_before_anything_runs(name, text, said, tmp_path, capsys,
                                                                         nothing_starts):
    """--results and what tune keeps beside it (probe.json, corrections.json) are read before the model is profiled."""
    path = tmp_path / "results" / name
    path.parent.mkdir()
    path.mkdir() if text is None else path.write_text(text)
    results = path if name == "bench.jsonl" else path.parent / "bench.jsonl"
    assert said.format(path=path) in refusal(capsys, *tune_args(tmp_path, "--results", results))


UNWRITABLE = Path("/proc/snnfw-cannot-write-here")  # refused to root as to anyone


@pytest.mark.parametrize("out, said", [
    (UNWRITABLE / "tuned.toml", f"--out {UNWRITABLE}/tuned.toml cannot be written"),
    (UNWRITABLE.parent, f"--out {UNWRITABLE.parent} is a folder; name the file to write in it"),
], ids=["unwritable", "folder"])
def test_an_out_that_cannot_be_written_is_refused_before_anything_runs(out, said, tmp_path, capsys, nothing_starts):
    assert said in refusal(capsys, *tune_args(tmp_path, "--out", out))


NO_SETTINGS = ["--set", "model.neuron_backend=torch", "--set", "train.precision=fp32", "--set", "memopt.level=0"]


def last_line_of_tune(tmp_path, capsys, monkeypatch, measurements, *args, budget_s=30):
    """tune in this process with ``snnfw bench`` replaced by ``measurements``, one ``(step ms or None, why not)``
    a candidate in the order tune measures them (a measured one appends a bench record, as bench does): the rows of
    its table and the chosen candidate (:func:`table_rows`), and its last line."""
    runs = iter(measurements)

    def bench(config_path, world, overrides, results, left_s):
        step_ms, why = next(runs)
        if step_ms is not None:
            record = {"step_ms": step_ms, "device": "cpu", "nproc": world, "plan": {"strategy": "planted"}}
            results.write_text((results.read_text() if results.exists() else "") + json.dumps(record) + "\n")
        return step_ms, why

    monkeypatch.setattr(tune, "_bench", bench)
    assert main([str(arg) for arg in tune_args(tmp_path, "--budget-s", budget_s, *NO_SETTINGS, *args)]) == 0
    out = capsys.readouterr().out.strip()
    return *table_rows(out.split("\n\n")[0]), out.splitlines()[-1]


@pytest.mark.parametrize("measurements, measure, why", [
    ([(None, tune.BUDGET_RAN_OUT), (500.0, "")], 2,
     "the budget ran out; give tune more --budget-s (it had 30) to measure it"),
    ([(500.0, "")], 1, "--measure is 1; raise it to measure it"),
], ids=["budget", "measure"])
def test_the_pick_is_the_fastest_measured_and_the_last_line_names_one_predicted_faster_left_unmeasured(
        measurements, measure, why, tmp_path, capsys, monkeypatch):
    """The budget stops the best predicted candidate's run and the next measures slow, or --measure leaves the others
    out: tune picks the measured one, and its last line says how many it measured, and that one predicted faster
    than the pick's measured step was not measured, why and how to have it measured."""
    rows, chosen, last = last_line_of_tune(tmp_path, capsys, monkeypatch, measurements, "--measure", measure)
    assert [(name, ms) for name, _, ms in rows if ms is not None] == [(chosen, 500.0)], rows
    faster = [(name, predicted) for name, predicted, ms in rows if ms is None and predicted < 500.0]
    more = f" (and {len(faster) - 1} more)" if len(faster) > 1 else ""
    assert last == (f"wrote {tmp_path / 'tuned.toml'}: {chosen}, the fastest measured (500.0 ms a step; 1 of "
                    f"{len(rows)} candidates measured); {faster[0][0]} is predicted faster ({faster[0][1]:.1f} ms)"
                    f"{more} but was not measured: {why}")


def test_a_pick_by_prediction_alone_says_so_in_the_last_line(tmp_path, capsys, monkeypatch):
    rows, chosen, last = last_line_of_tune(tmp_path, capsys, monkeypatch, [], "--measure", 0, budget_s=10)
    assert chosen == rows[0][0], rows
    assert last == (f"wrote {tmp_path / 'tuned.toml'}: {chosen}, the fastest predicted ({rows[0][1]:.1f} ms a step), "
                    f"not measured (0 of {len(rows)} candidates measured): --measure is 0; raise it to measure it")


def test_when_every_measured_candidate_fails_tune_refuses_rather_than_pick_one(tmp_path, capsys, monkeypatch):
    runs = iter([(None, "its run failed (ValueError: planted)")] * 99)
    monkeypatch.setattr(tune, "_bench", lambda *args: next(runs))
    assert main([str(arg) for arg in tune_args(tmp_path, "--budget-s", 30, "--measure", 99, *NO_SETTINGS)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("snnfw: error: every candidate failed to run (the errors "
                                                        "above); correct what they say and tune again")
    assert not (tmp_path / "tuned.toml").exists()
