"""The fused LIF kernel computes what SpikingJelly's LIF operator computes, for every option it takes.

Every combination of the options runs through the kernel's torch code
eagerly against SpikingJelly's ``LIFNode`` (two calls in a row, so the second
starts from the first one's voltage and the gradient flows back through it);
the compiled kernels (Inductor's C++ on this CPU) run for the VGG's options
and for a soft reset without a detached reset. float32 spikes and voltages
are equal; gradients are within 2 float32 ulps of their largest entry
(measured: up to 1.3 with a reset that is not detached; compiled, 0 for the
VGG's options and 0.8 for the other case, whose sigmoid is Inductor's own).
"""

import itertools

import pytest
import torch
from spikingjelly.activation_based import neuron, surrogate

from snnfw_plugins import lif_kernel

OPTIONS = list(itertools.product((True, False), (True, False), (0.0, None, -0.1)))  # decay_input, detach_reset, v_reset


def lif(decay_input, detach_reset, v_reset, surrogate_name="ATan"):
    return neuron.LIFNode(tau=1.7, decay_input=decay_input, v_reset=v_reset, detach_reset=detach_reset,
                          surrogate_function=getattr(surrogate, surrogate_name)(), step_mode="m")


def two_calls(node, x0, grad):
    """Spikes of two calls, the final voltage and the input's gradient."""
    x = x0.clone().requires_grad_()
    first, second = node(x), node(x * 0.5)
    ((first * grad).sum() + (second * grad).sum()).backward()
    return first, second, node.v, x.grad


@pytest.fixture
def eager_kernels(monkeypatch):
    """The kernel's torch code without compiling it (fast; the compiled test below covers Inductor)."""
    monkeypatch.setattr(lif_kernel, "_kernel", lambda name, fn, example: fn)


def compare(options, surrogate_name, dtype=torch.float32, shape=(4, 3, 5, 6)):
    torch.manual_seed(0)
    x0, grad = torch.randn(shape, dtype=dtype) * 1.5, torch.randn(shape, dtype=dtype)
    reference = two_calls(lif(*options, surrogate_name), x0, grad)
    fused_node = lif(*options, surrogate_name)
    assert lif_kernel.fits(fused_node)
    lif_kernel.install(fused_node)
    fused = two_calls(fused_node, x0, grad)
    assert 0 < reference[0].mean() < 1  # neurons that fire, and not always
    return reference, fused


def assert_same(reference, fused):
    first, second, v, grad = fused
    assert torch.equal(first, reference[0]) and torch.equal(second, reference[1])
    assert torch.equal(v, reference[2])
    ulp = torch.finfo(grad.dtype).eps * reference[3].abs().max()
    assert (grad - reference[3]).abs().max() <= 2 * ulp


@pytest.mark.parametrize("surrogate_name", list(lif_kernel.SURROGATE_GRADIENTS))
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: f"decay{o[0]}-detach{o[1]}-reset{o[2]}")
def test_the_kernels_code_equals_spikingjelly(options, surrogate_name, eager_kernels):
    assert_same(*compare(options, surrogate_name))


@pytest.mark.parametrize("options, surrogate_name", [((False, True, 0.0), "ATan"), ((True, False, None), "Sigmoid")])
def test_the_compiled_kernels_equal_spikingjelly(options, surrogate_name):
    assert_same(*compare(options, surrogate_name, shape=(4, 2, 8, 7, 7)))


def test_float64_and_bf16(eager_kernels):
    """float64 runs in float64, as SpikingJelly's reference does. bf16 runs in float32 with the voltage kept in
    float32 over the sequence (SpikingJelly rounds it to bf16 at every op on the CPU): its spikes and voltage equal
    SpikingJelly's float32 on the same values, and its gradient is SpikingJelly's float32 gradient rounded to bf16.
    (Between two calls SpikingJelly's state handling rounds the voltage to the input's dtype, so one call here.)"""
    reference, fused = compare((False, True, 0.0), "ATan", torch.float64)
    for a, b in zip(reference, fused):
        assert b.dtype == torch.float64 and torch.allclose(a, b, rtol=1e-15, atol=1e-15)
    torch.manual_seed(0)
    x0, grad = (torch.randn(4, 3, 5, 6) * 1.5).bfloat16(), torch.randn(4, 3, 5, 6).bfloat16()
    exact, fused = lif(False, True, 0.0), lif(False, True, 0.0)
    lif_kernel.install(fused)
    for node, x in ((exact, x0.float().requires_grad_()), (fused, x0.clone().requires_grad_())):
        node.spikes = node(x)
        (node.spikes * grad.to(x.dtype)).sum().backward()
        node.x_grad = x.grad
    assert fused.spikes.dtype == fused.x_grad.dtype == torch.bfloat16 and fused.v.dtype == torch.float32
    assert torch.equal(fused.spikes.float(), exact.spikes) and torch.equal(fused.v, exact.v)
    assert torch.allclose(fused.x_grad.float(), exact.x_grad.bfloat16().float(), rtol=2 ** -7, atol=0)


def test_which_neurons_it_takes():
    assert lif_kernel.fits(lif(False, True, 0.0))
    assert not lif_kernel.fits(neuron.LIFNode(store_v_seq=True, step_mode="m"))  # the voltage trace is SpikingJelly's
    assert not lif_kernel.fits(neuron.ParametricLIFNode(step_mode="m"))  # a learned tau
    assert not lif_kernel.fits(neuron.LIFNode(surrogate_function=surrogate.ATan(spiking=False), step_mode="m"))
    own = neuron.LIFNode(surrogate_function=lambda x: (x >= 0).float(), step_mode="m")
    assert not lif_kernel.fits(own)
