"""A build recorded on the meta device replays each tensor alone, bit for bit as the CPU build made it, and leaves
the generator where that build leaves it; a build a replay could get wrong is refused."""

import pytest
import torch
from torch import nn
from torch.nn.init import orthogonal_ as orthogonal_imported_before

from snnfw.config import build_config
from snnfw.model import recipe
from snnfw.model import source as models
from snnfw.plugin.manager import Plugins


def family(name):
    config = build_config({"model": {"family": name, "flavor": "tiny"}, "data": {"name": "synthetic_dvs"}})
    source = models.source(config, Plugins())

    def build():
        torch.manual_seed(7)
        return source.build()
    return build


class Tied(nn.Module):
    """What a user's builder does beyond layers: its own seed, constants, a parameter computed from a draw, a
    tied weight, torch's initialisers that skip the meta device, a slice written in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(12, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.randn(6) * 0.02 + torch.tensor([1.0, 2, 3, 4, 5, 6]))
        self.mix = nn.Parameter(torch.empty(6, 6))
        nn.init.orthogonal_(self.mix)
        self.proj = nn.Linear(6, 6)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        with torch.no_grad():
            self.proj.bias[2:4].fill_(0.5)
        self.register_buffer("steps", torch.tensor(4, dtype=torch.long))


def named(model):
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("build", [family("cifar10dvs_vgg"), family("spikformer"), Tied], ids=["vgg", "spikformer", "own"])
def test_each_tensor_replays_as_the_cpu_build_made_it(build):
    torch.manual_seed(0)
    eager = named(build())
    after_build = torch.get_rng_state()
    torch.manual_seed(0)
    model, made = recipe.record(build)
    assert all(tensor.is_meta for tensor in named(model).values())
    assert torch.equal(torch.get_rng_state(), after_build), "the recording leaves the generator elsewhere"
    for name, want in eager.items():
        got = made.value(name)
        assert got.dtype == want.dtype and got.stride() == want.stride(), name
        assert torch.equal(got, want), f"{name} replays other values"
    assert torch.equal(torch.get_rng_state(), after_build), "a replay moved the generator"


class ValueDependentDraw(nn.Module):
    def __init__(self):
        super().__init__()
        self.rates = nn.Parameter(torch.poisson(torch.full((4,), 3.0)))


class OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4).uniform_(generator=torch.Generator().manual_seed(1)))


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        if self.weight.sum() > 10:
            raise AssertionError("unreachable")


class InitialiserImportedBefore(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        orthogonal_imported_before(self.weight)


@pytest.mark.parametrize("build", [ValueDependentDraw, OwnGenerator, ReadsValues, InitialiserImportedBefore])
def test_a_build_a_replay_could_get_wrong_is_refused_and_the_generator_left_as_it_was(build):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert recipe.record(build) is None
    assert torch.equal(torch.get_rng_state(), before)
