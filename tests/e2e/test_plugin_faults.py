"""A plugin at fault ends a command with one line naming it, never a traceback."""

import os
import subprocess
import sys

from snnfw.cli import main
from snnfw.testing.distribution import install_distribution

TINY = ["train.steps=3", "data.batch_size=8", "data.train_samples=64", "data.test_samples=16"]


def snnfw(*args, env=None, timeout=180):
    cmd = [sys.executable, "-m", "snnfw", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def train(run_dir, env=None):
    """snnfw train of the quickstart, shortened, on 2 ranks."""
    return snnfw("train", "examples/quickstart.toml", "--nproc", "2", "--run-dir", str(run_dir),
                 *(arg for item in TINY for arg in ("--set", item)), env=env)


def test_a_plugins_hook_that_raises_in_a_rank_is_named_on_one_line(faults, tmp_path):
    done = train(tmp_path / "run", env={"SNNFW_TEST_RAISE_AT_STEP": "2"})
    log = tmp_path / "run" / "error.log"
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("snnfw: error:") == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "snnfw: error: plugin 'snnfw.testing.faults' (registered in-process), hook snnfw_step_start: RuntimeError: "
        f"test fault: rank 1 raises before step 2; the traceback is in {log}")
    assert "in snnfw_step_start\n" in log.read_text()


def test_a_plugins_hook_that_raises_while_planning_is_named_on_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "raising_planner.py").write_text(
        "from snnfw import hookimpl\n\n@hookimpl\ndef snnfw_plan(request):\n    raise KeyError('budget')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SNNFW_PLUGINS", "raising_planner")
    assert main(["plan", "examples/quickstart.toml", "--world-size", "2"]) == 2
    assert capsys.readouterr().err == (
        "snnfw: error: plugin 'raising_planner' (registered in-process), hook snnfw_plan: KeyError: 'budget'; fix or "
        "uninstall the plugin (snnfw --debug shows the traceback)\n")


WRONG_SIGNATURE = """
    from snnfw import hookimpl

    @hookimpl
    def snnfw_step_start(step, rank, epoch):
        pass
"""
REFUSED = ("snnfw: error: plugin 'wrong' (snnfw_wrong 1.0) implements hook snnfw_step_start as "
           "snnfw_step_start(step, rank, epoch), which the hook cannot call: epoch is not among its arguments (step, "
           "rank, hooks); take only those, by name, or uninstall or block the plugin (SNNFW_BLOCK_PLUGINS=wrong)\n")


def test_a_hook_implementation_of_the_wrong_signature_is_refused_on_one_line(tmp_path, monkeypatch, capsys):
    site = install_distribution(tmp_path, monkeypatch, "snnfw_wrong", WRONG_SIGNATURE,
                                {"snnfw": {"wrong": "snnfw_wrong"}})
    assert main(["plugins"]) == 2
    assert capsys.readouterr().err == REFUSED
    path = os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))
    done = train(tmp_path / "run", env={"PYTHONPATH": path})
    assert (done.returncode, done.stderr) == (2, REFUSED)
    assert not (tmp_path / "run").exists()  # refused before any rank started


EXITS = """
    import sys

    sys.exit(3)
"""


def test_a_plugin_that_exits_while_imported_is_named_on_one_line(tmp_path, monkeypatch, capsys):
    install_distribution(tmp_path, monkeypatch, "snnfw_exits", EXITS, {"snnfw": {"exits": "snnfw_exits"}})
    for command in (["plugins"], ["plan", "examples/quickstart.toml", "--world-size", "2"]):
        assert main(command) == 2
        assert capsys.readouterr().err == (
            "snnfw: error: plugin 'exits' (snnfw_exits 1.0) exited with status 3 while being imported (sys.exit); fix "
            "it, or uninstall or block the plugin (SNNFW_BLOCK_PLUGINS=exits)\n")
    monkeypatch.setenv("SNNFW_BLOCK_PLUGINS", "exits")
    assert main(["plugins"]) == 0
