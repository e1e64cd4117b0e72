"""``snnfw export``: a checkpoint of any strategy becomes a plain state dict that the family's own module loads."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spikingjelly.activation_based import functional

from snnfw.cli import main
from snnfw.config import build_config
from snnfw.plan.prepare import build_datasets, build_model
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_evaluation
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import final_state

STEPS = 3
ROOT = Path(__file__).resolve().parents[2]


def config(strategy, microbatches=1, every=STEPS, mesh=None):
    return build_config({
        "model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4},
        "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 64, "test_samples": 32},
        "train": {"steps": STEPS, "lr": 0.01, "seed": 3, "microbatches": microbatches},
        "checkpoint": {"every": every},
        "parallel": {"strategy": strategy, "device": "cpu", **({"mesh": mesh} if mesh else {})},
    })


def trained(tmp_path_factory, strategy, microbatches=1, mesh=None):
    run_dir = tmp_path_factory.mktemp(strategy)
    ranks = math.prod(mesh.values()) if mesh else 2
    summaries = run_on_ranks(config(strategy, microbatches, mesh=mesh), ranks, run_dir, timeout_s=180, inspect=final_state)
    final = summaries[0]["inspect"]
    return run_dir, final


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """tp on 2 ranks: every layer's channels sliced across the ranks."""
    return trained(tmp_path_factory, "tp")


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """fsdp2 on 2 ranks: every parameter sharded along its first dimension."""
    return trained(tmp_path_factory, "fsdp2")


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """pp on 2 ranks: each rank holds one stage."""
    return trained(tmp_path_factory, "pp", microbatches=2)


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """A composed mesh on 4 ranks: two pipeline stages, each tensor-parallel over 2 ranks."""
    return trained(tmp_path_factory, "mesh", microbatches=2, mesh={"pp": 2, "tp": 2})


def export_cli(source, out):
    done = subprocess.run([sys.executable, "-m", "snnfw", "export", str(source), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def none_predictions(checkpoint, out):
    """The logits of every test sample that snnfw's none evaluation of ``checkpoint`` predicts."""
    run_evaluation(config("none", every=0), checkpoint, predict=out)
    return torch.tensor([json.loads(line)["logits"] for line in out.read_text().splitlines()])


def module_logits(model):
    """The logits of every test sample from the family's module run by hand (eval mode, state reset)."""
    test_set = build_datasets(config("none"), build_model(config("none"), Plugins())[1], Plugins())[1]
    frames = torch.stack([test_set[i][0] for i in range(len(test_set))])
    model.eval()
    with torch.no_grad():
        functional.reset_net(model)
        return model(frames).mean(0)


@pytest.mark.parametrize("run", ["tp_run", "fsdp2_run", "pp_run", "mesh_run"])
def test_export_loads_into_the_family_module_which_computes_what_snnfw_predicts(request, tmp_path, run):
    """The export of a sharded or staged checkpoint loads strictly, equals the state the ranks held, and the
    module with it gives the logits that snnfw's none evaluation of the same checkpoint predicts."""
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
    checkpoint = run_dir / "checkpoints" / f"step-{STEPS}"
    strategy, ranks = run.removesuffix("_run"), 4 if run == "mesh_run" else 2
    assert stdout.splitlines() == [
        f"exported step {STEPS} of {checkpoint} ({strategy} on {ranks} rank(s)): "
        f"{len(exported)} tensors, {parameters:,} parameters and {sum(b.numel() for b in model.buffers()):,} "
        f"buffer values -> {out}"
    ]
    predicted = none_predictions(checkpoint, tmp_path / "rows.jsonl")
    assert predicted.shape == (32, 10)
    assert torch.allclose(predicted, module_logits(model), atol=1e-5, rtol=1e-5)


def test_a_checkpoint_folder_is_exported_as_it_is(tp_run, tmp_path, capsys):
    run_dir, final = tp_run
    out = tmp_path / "sub" / "step.pt"
    assert main(["export", str(run_dir / "checkpoints" / f"step-{STEPS}"), "--out", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[name], tensor) for name, tensor in final.items())
    assert capsys.readouterr().out.startswith(f"exported step {STEPS} of ")


def test_a_folder_without_checkpoints_is_refused_naming_what_was_looked_for(tmp_path, capsys):
    status = main(["export", str(tmp_path), "--out", str(tmp_path / "x.pt")])
    stdout, stderr = capsys.readouterr()
    assert status == 2 and stdout == ""
    assert stderr.splitlines() == [
        f"snnfw: error: {tmp_path} holds no final_model.pt (written when a run ends) and no complete checkpoint: looked "
        f"for {tmp_path / 'checkpoints'}/step-K folders with meta.json (written with checkpoint.every = N and --run-dir)"
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


def test_the_families_state_maps_onto_spikingjelly_zoo_classes():
    """What snnfw export writes (the family module's own names) loads strictly into SpikingJelly's model-zoo
    classes: the full VGG into CIFAR10DVSVGG with its classifier renamed (the zoo's dropout takes index 0),
    Spikformer into Spikformer without the family wrapper's ``net.`` prefix."""
    from spikingjelly.activation_based.examples.memopt.models import CIFAR10DVSVGG
    from spikingjelly.activation_based.model.spikformer import Spikformer

    from snnfw_plugins.families.spikformer import TINY

    vgg = build_model(build_config({"model": {"family": "cifar10dvs_vgg", "flavor": "full"}}), Plugins())[0].state_dict()
    CIFAR10DVSVGG().load_state_dict({k.replace("classifier.0.", "classifier.1."): v for k, v in vgg.items()}, strict=True)
    former = build_model(build_config({"model": {"family": "spikformer", "flavor": "tiny"}}), Plugins())[0].state_dict()
    Spikformer(**TINY).load_state_dict({k.removeprefix("net."): v for k, v in former.items()}, strict=True)


def test_a_run_with_only_its_best_model_is_told_to_name_it(tmp_path, capsys):
    torch.save({"w": torch.zeros(1)}, tmp_path / "best_model.pt")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "x.pt")]) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        f"; name {tmp_path / 'best_model.pt'}, the best validation's weights, to export them")
    assert main(["export", str(tmp_path / "best_model.pt"), "--out", str(tmp_path / "x.pt")]) == 0
    assert capsys.readouterr().out == f"exported {tmp_path / 'best_model.pt'}: 1 tensors, 1 values -> {tmp_path / 'x.pt'}\n"


def test_the_final_model_is_exported_where_it_is_newer_than_the_last_checkpoint(tp_run, tmp_path, capsys):
    """A run that ended after its last checkpoint (summary at step 4, checkpoint at step 3): its final_model.pt is
    its newest weights, in both formats; at the same step the checkpoint, whose files have digests, is read."""
    run_dir = tmp_path / "run"
    shutil.copytree(tp_run[0], run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "steps": STEPS + 1}))
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x.pt")]) == 0
    assert capsys.readouterr().out.startswith(f"exported step {STEPS + 1} of {run_dir / 'final_model.pt'} (tp on 2 ")


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """The quickstart (strategy dp, no checkpoints) trained by snnfw train on 2 ranks for 20 small steps: enough
    for every neuron layer of the tiny VGG to fire in eval mode (after 3, its batch norms' running statistics
    leave features.5 silent)."""
    run_dir = tmp_path_factory.mktemp("quickstart")
    small = ["train.steps=20", "train.log_every=20", "data.train_samples=64", "data.test_samples=8", "data.batch_size=8"]
    done = subprocess.run([sys.executable, "-m", "snnfw", "train", "examples/quickstart.toml", "--nproc", "2",
                           "--run-dir", str(run_dir), "--overwrite", *(f"--set={item}" for item in small)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return run_dir


def test_nir_export_of_a_dp_run_reads_its_config_and_runs_in_one_process(quickstart_run, tmp_path):
    """snnfw export RUN --format nir: the run's own config (strategy dp, 2 ranks) from its directory, no --config,
    in one process; --set applied (2 test samples checked); the file reads back with nir.read."""
    nir = pytest.importorskip("nir")
    out = tmp_path / "net.nir"
    done = subprocess.run([sys.executable, "-m", "snnfw", "export", str(quickstart_run), "--format", "nir", "--out",
                           str(out), "--set", "data.test_samples=2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"exported {quickstart_run / 'final_model.pt'} as NIR: 24 nodes; checked on 2 test "
                                  "samples, on which every neuron layer fires")
    graph = nir.read(str(out))
    kinds = [type(node).__name__ for node in graph.nodes.values()]
    assert kinds.count("LIF") == 8 and kinds.count("Conv2d") == 8 and graph.metadata["dt"] == 1e-4


def test_a_run_without_checkpoints_exports_its_final_model_in_both_formats(quickstart_run, tmp_path, capsys):
    """The plain export reads what --format nir reads: a run's final_model.pt, its step and strategy from the
    run's summary."""
    out = tmp_path / "net.pt"
    assert main(["export", str(quickstart_run), "--out", str(out)]) == 0
    final = quickstart_run / "final_model.pt"
    assert capsys.readouterr().out.startswith(f"exported step 20 of {final} (dp on 2 rank(s)): ")
    exported, trained = torch.load(out, weights_only=True), torch.load(final, weights_only=True)
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
