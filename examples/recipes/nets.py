"""SpikingJelly's model-zoo networks of the PLIF paper, built as the recipes here train them (``model.builder``).

Fang et al., "Incorporating Learnable Membrane Time Constant to Enhance
Learning of Spiking Neural Networks", ICCV 2021: ``DVSGestureNet`` and
``NMNISTNet`` in ``spikingjelly.activation_based.model.parametric_lif_net``,
in multi-step mode, taking ``[T, N, C, H, W]`` and returning the firing rates
of their voting layer ``[T, N, classes]``.
"""

from spikingjelly.activation_based import functional, neuron, surrogate
from spikingjelly.activation_based.model import parametric_lif_net


def dvs_gesture_net():
    """The DVS128 Gesture network with LIF neurons, as SpikingJelly's classify_dvsg example builds it."""
    net = parametric_lif_net.DVSGestureNet(channels=128, spiking_neuron=neuron.LIFNode,
                                           surrogate_function=surrogate.ATan(), detach_reset=True)
    functional.set_step_mode(net, "m")
    return net


def nmnist_net():
    """The N-MNIST network with the paper's parametric LIF neurons (a learned membrane time constant)."""
    net = parametric_lif_net.NMNISTNet(channels=128, spiking_neuron=neuron.ParametricLIFNode,
                                       surrogate_function=surrogate.ATan(), detach_reset=True)
    functional.set_step_mode(net, "m")
    return net
