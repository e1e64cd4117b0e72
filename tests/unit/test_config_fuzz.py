"""A fuzz of the config: every key mutated into wrong kinds and out-of-range values, or misspelt, is either planned
or refused with a user error (one line at the command line), never another exception; so is a config file cut short
or bit-flipped."""

import math
import random

import attrs

from snnfw.config import build_config
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import TINY
from snnfw.testing.checks import user_outcome

MUTATIONS = [None, True, -1, 0, 1, 2**63, -(2**63), 1e300, -1e-300, math.inf, -math.inf, math.nan, "", "x" * 300,
             "auto", [], [1.5, 2], {"a": 1}, 3.5, "1|0|2"]
SECTIONS = ("model", "data", "parallel", "pipeline", "train", "checkpoint", "memopt", "compile", "tsp", "eval", "log")
TRIES = 400


def _keys():
    defaults = build_config({})
    classes = {name: type(getattr(defaults, name)) for name in SECTIONS}
    return [(section, field.name) for section, cls in classes.items() for field in attrs.fields(cls)
            if (section, field.name) not in {("data", "root"), ("data", "builder"), ("model", "builder")}]


def test_mutated_configs_plan_or_are_refused_with_a_user_error():
    plugins, rng = Plugins(), random.Random(0)
    keys = _keys()
    outcomes = {"done": 0, "refused": 0}
    for _ in range(TRIES):
        data = {section: dict(table) for section, table in TINY.items()}
        data["parallel"] = {"strategy": rng.choice(["none", "dp", "tp", "fsdp2", "pp"]), "device": "cpu"}
        for section, key in rng.sample(keys, rng.choice([1, 1, 2])):
            if rng.random() < 0.1:  # a misspelt key, with a value of its own kind
                key = rng.choice([key.upper(), key + "s", key[:-1], key.replace("_", "-")])
            data.setdefault(section, {})[key] = rng.choice(MUTATIONS)

        def plan(data=data):
            config = build_config(data)
            prepare(config, 2 if config.parallel.strategy != "none" else 1, plugins)

        outcomes[user_outcome(plan, str(data))] += 1
    print(f"config fuzz: {TRIES} mutated configs, {outcomes}")
    assert outcomes["refused"] > TRIES / 2


def test_mutated_config_files_are_read_or_refused_with_a_user_error(tmp_path):
    """The quickstart's TOML cut short or bit-flipped: read and planned, or refused in one line (bad TOML, bad UTF-8, a
    bad key or value)."""
    from pathlib import Path

    from snnfw.config import load_config

    plugins = Plugins()

    def plan(path):
        config = load_config(path)
        prepare(config, 2 if config.parallel.strategy != "none" else 1, plugins)

    text = (Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml").read_bytes()
    rng, outcomes = random.Random(1), {"done": 0, "refused": 0}
    for attempt in range(TRIES):
        data = bytearray(text[: rng.randrange(len(text) + 1)] if rng.random() < 0.3 else text)
        for _ in range(rng.randint(0, 6)):
            if data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path = tmp_path / f"{attempt}.toml"
        path.write_bytes(bytes(data))
        outcomes[user_outcome(lambda: plan(path), repr(bytes(data)))] += 1
    print(f"config file fuzz: {TRIES} mutated files, {outcomes}")
    assert outcomes["refused"] > TRIES / 4
