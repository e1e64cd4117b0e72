"""What a run needs besides snnfw is checked before any rank starts: one line, exit status 2."""

import sys
from pathlib import Path

import pytest

from snnfw.cli import main
from snnfw.tools import launch

QUICKSTART = str(Path(__file__).parents[2] / "examples" / "quickstart.toml")


@pytest.fixture
def unlaunched(monkeypatch, tmp_path):
    """No rank may start; no login is found but where a test puts one."""

    def refused(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(launch, "launch", refused)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refusal(capsys, *settings):
    args = ["train", QUICKSTART, "--nproc", "2", "--run-dir", "run"]
    assert main([*args, *(arg for item in settings for arg in ("--set", item))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("key, package", [("log.tensorboard=true", "tensorboard"), ('log.wandb="offline"', "wandb")])
def test_a_log_whose_package_is_absent_is_refused_before_launch(unlaunched, monkeypatch, capsys, key, package):
    monkeypatch.setitem(sys.modules, package, None)  # not importable
    err = refusal(capsys, key)
    assert f"needs the {package} package, which is not installed; run `SNNFW_EXTRAS=" in err and f"or remove {key.split('=')[0]}" in err


@pytest.mark.parametrize("key, package", [("log.tensorboard=true", "tensorboard"), ('log.wandb="offline"', "wandb")])
def test_a_log_whose_package_is_too_old_is_refused_before_launch(unlaunched, monkeypatch, capsys, key, package):
    from snnfw.components import extras

    monkeypatch.setattr(extras.metadata, "version", lambda name: "0.9.1" if name == package else metadata_version(name))
    err = refusal(capsys, key)
    assert f"needs {package} {extras.MINIMUM[package]} or newer, and 0.9.1 is installed" in err


def metadata_version(name):
    from importlib import metadata

    return metadata.version(name)


def test_wandb_online_without_a_login_is_refused_before_launch(unlaunched, monkeypatch, capsys):
    err = refusal(capsys, 'log.wandb="online"')
    assert 'no login was found (WANDB_API_KEY, or api.wandb.ai in' in err and 'set log.wandb = "offline"' in err
    (unlaunched / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    with pytest.raises(AssertionError, match="ranks were launched"):  # a login: the run goes on to launch
        main(["train", QUICKSTART, "--nproc", "2", "--run-dir", "run", "--set", 'log.wandb="online"'])
