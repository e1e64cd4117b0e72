"""A third-party plugin that fails to import is left out with one warning: listed as not loaded, the quickstart
trains without it on 2 ranks, and what only it would provide is refused naming it. A built-in's failure stays an
error."""

import os
import re
import subprocess
import sys

import pytest

from snnfw import entry_points
from snnfw.cli import main
from snnfw.entry_points import GROUP, SECTIONS_GROUP
from snnfw.errors import ConfigError, PlanError, PluginError, UnknownNameError
from snnfw.plan import planfile
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config
from snnfw.testing.distribution import install_distribution

BROKEN = """
    import attrs

    import snnfw_missing_dependency  # not installed


    @attrs.frozen
    class Section:
        depth: int = 1
"""
ERROR = "ModuleNotFoundError(\"No module named 'snnfw_missing_dependency'\")"
FAILED = f"'broken' (snnfw_broken 1.0) failed to import: {ERROR}"
FAILED_RE, ERROR_RE = re.escape(FAILED), re.escape(ERROR)


@pytest.fixture
def broken(tmp_path, monkeypatch):
    """The plugin installed with a config section of its own; warnings not yet given in this process."""
    monkeypatch.setattr(entry_points, "_warned", set())
    return install_distribution(tmp_path, monkeypatch, "snnfw_broken", BROKEN,
                                {GROUP: {"broken": "snnfw_broken"}, SECTIONS_GROUP: {"broken": "snnfw_broken:Section"}})


def test_it_is_listed_as_not_loaded_and_warned_about_once(broken, capsys):
    assert main(["plugins"]) == 0
    out, err = capsys.readouterr()
    assert f"broken (snnfw_broken 1.0)\n    not loaded: failed to import: {ERROR}\n" in out
    assert err.splitlines() == [f"snnfw: warning: plugin {FAILED}; it is left out, and commands that need it are "
                                "refused until it is fixed or uninstalled"]
    Plugins(), tiny_config("dp")
    assert capsys.readouterr().err == ""


def test_what_it_would_provide_is_refused_naming_it(broken):
    plugins = Plugins()
    with pytest.raises(UnknownNameError, match=f"unknown strategy 'deep'.*; plugin {FAILED_RE}, and may be the one that "
                                               "registers it: fix or uninstall it$"):
        prepare(tiny_config("deep"), 2, plugins)
    with pytest.raises(ConfigError, match=rf"^config section \[broken\] is declared by plugin {FAILED_RE}; fix or "):
        tiny_config("dp", broken={"depth": 2})


def test_ranks_that_differ_from_the_plan_are_refused_with_the_error(broken, tmp_path):
    path, failing = tmp_path / "plan.json", Plugins()
    plan = prepare(tiny_config("dp"), 2, failing).plan
    planfile.write(path, plan, failing, "made-for")
    assert planfile.read(path, failing, "made-for") == plan
    (broken / "snnfw_broken.py").write_text("")  # the dependency installed on this rank
    sys.modules.pop("snnfw_broken", None)
    loading = Plugins()
    with pytest.raises(PlanError, match=rf"^plugin 'broken' is loaded on this rank \(version 1.0\) and failed to "
                                        rf"import when snnfw train planned the run \({path}\) \({ERROR_RE}\); install"):
        planfile.read(path, loading, "made-for")
    planfile.write(path, plan, loading, "made-for")
    with pytest.raises(PlanError, match=rf"^plugin 'broken' was loaded \(version 1.0\) when snnfw train planned the "
                                        rf"run \({path}\) and failed to import on this rank \({ERROR_RE}\); install"):
        planfile.read(path, failing, "made-for")


def test_a_builtin_that_fails_to_import_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "snnfw_own_broken.py").write_text("import snnfw_missing_dependency\n")
    info = tmp_path / "snnfw-9.dist-info"  # as if snnfw itself declared it
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: snnfw\nVersion: 9\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nown_broken = snnfw_own_broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="plugin 'own_broken' .* failed to import: ModuleNotFoundError"):
        Plugins()


def test_the_quickstart_trains_beside_it_on_2_ranks(broken, tmp_path):
    """snnfw train as the README has it, shortened: the launcher warns once, its ranks agree and do not warn again."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "snnfw", "train", "examples/quickstart.toml", "--nproc", "2", "--run-dir", str(run_dir),
           "--set", "train.steps=2", "--set", "train.log_every=1", "--set", "data.train_samples=128",
           "--set", "data.test_samples=32"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(broken), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "warning" in line] == [
        f"snnfw: warning: plugin {FAILED}; it is left out, and commands that need it are refused until it is fixed "
        "or uninstalled"]
    assert (run_dir / "summary.json").exists()
