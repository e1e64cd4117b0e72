"""``snnfw export``: a checkpoint of any strategy becomes a plain state dict that the family's own module loads."""

import json
import subprocess
import sys

import pytest
import torch
from spikingjelly.activation_based import functional

from snnfw.cli import main
from snnfw.config import build_config
from snnfw.plugins import Plugins
from snnfw.prepare import build_model
from snnfw.testing import run_on_ranks

STEPS = 2
pytestmark = pytest.mark.usefixtures("one_thread")


def config(strategy, microbatches=1, every=STEPS):
    return build_config({
        "model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4},
        "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 64, "test_samples": 32},
        "train": {"steps": STEPS, "lr": 0.01, "seed": 3, "microbatches": microbatches},
        "checkpoint": {"every": every},
        "parallel": {"strategy": strategy, "device": "cpu"},
    })


def model_state(trainer):
    """The model state this rank holds at the end, by the model's own names (a collective under tp)."""
    state = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)["model"]
    return {name: t.detach().cpu().clone() for name, t in state.items()}


def trained(tmp_path_factory, strategy, microbatches=1):
    run_dir = tmp_path_factory.mktemp(strategy)
    summaries = run_on_ranks(config(strategy, microbatches), 2, run_dir, timeout_s=180, inspect=model_state)
    final = {name: t for summary in summaries for name, t in summary["inspect"].items()}  # pp: the union of stages
    return run_dir, final


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """tp on 2 ranks: every layer's channels sliced across the ranks."""
    return trained(tmp_path_factory, "tp")


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """pp on 2 ranks: each rank holds one stage."""
    return trained(tmp_path_factory, "pp", microbatches=2)


def export_cli(source, out):
    done = subprocess.run([sys.executable, "-m", "snnfw", "export", str(source), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("run", ["tp_run", "pp_run"])
def test_export_loads_into_the_family_module_and_equals_the_trained_state(request, tmp_path, run):
    run_dir, final = request.getfixturevalue(run)
    out = tmp_path / "x.pt"
    status, stdout, stderr = export_cli(run_dir, out)
    assert status == 0, stderr
    exported = torch.load(out, weights_only=True)
    model = build_model(config("none"), Plugins())[0]
    model.load_state_dict(exported, strict=True)
    assert sorted(exported) == sorted(final) == sorted(model.state_dict())
    for name, tensor in final.items():
        assert torch.equal(exported[name], tensor), name
    parameters = sum(p.numel() for p in model.parameters())
    assert stdout.splitlines() == [
        f"exported step {STEPS} of {run_dir / 'checkpoints' / f'step-{STEPS}'} ({run[:2]} on 2 rank(s)): "
        f"{len(exported)} tensors, {parameters:,} parameters and {sum(b.numel() for b in model.buffers()):,} "
        f"buffer values -> {out}"
    ]


def test_a_checkpoint_folder_is_exported_as_it_is(tp_run, tmp_path, capsys):
    run_dir, final = tp_run
    out = tmp_path / "sub" / "step.pt"
    assert main(["export", str(run_dir / "checkpoints" / f"step-{STEPS}"), "--out", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[name], tensor) for name, tensor in final.items())
    assert capsys.readouterr().out.startswith(f"exported step {STEPS} of ")


def test_a_folder_without_checkpoints_is_refused_naming_what_was_looked_for(tmp_path):
    status, stdout, stderr = export_cli(tmp_path, tmp_path / "x.pt")
    assert status == 2 and stdout == ""
    assert stderr.splitlines() == [
        f"snnfw: error: {tmp_path} holds no complete checkpoint: looked for {tmp_path / 'checkpoints'}/step-K folders "
        "with meta.json (written with checkpoint.every = N and --run-dir)"
    ]
    assert not (tmp_path / "x.pt").exists()


def test_safetensors_without_the_package_is_refused_naming_it(tp_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # importing it then fails
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "x.safetensors"
    assert main(["export", str(tp_run[0]), "--out", str(out)]) == 2
    assert "the safetensors package is not importable" in capsys.readouterr().err
    assert not out.exists()


def test_safetensors_is_written_when_the_package_is_there(tp_run, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    run_dir, final = tp_run
    out = tmp_path / "x.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    exported = safetensors.load_file(str(out))
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[name], tensor) for name, tensor in final.items())


def test_the_exported_module_computes_the_logits_snnfw_predicts_from_the_checkpoint(tp_run, tmp_path):
    """The family's module with the export of a tp checkpoint, run by hand, gives the logits that snnfw's
    none evaluation of the same checkpoint predicts for every test sample."""
    from snnfw.prepare import build_datasets
    from snnfw.runtime import run_evaluation

    run_dir, _ = tp_run
    checkpoint = run_dir / "checkpoints" / f"step-{STEPS}"
    assert export_cli(checkpoint, tmp_path / "x.pt")[0] == 0
    run_evaluation(config("none", every=0), checkpoint, predict=tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    model, spec = build_model(config("none"), Plugins())
    model.load_state_dict(torch.load(tmp_path / "x.pt", weights_only=True), strict=True)
    model.eval()
    test_set = build_datasets(config("none"), spec, Plugins())[1]
    frames = torch.stack([test_set[i][0] for i in range(len(test_set))])
    with torch.no_grad():
        functional.reset_net(model)
        logits = model(frames).mean(0)
    assert len(rows) == len(test_set) == 32
    assert torch.allclose(torch.tensor([row["logits"] for row in rows]), logits, atol=1e-5, rtol=1e-5)
