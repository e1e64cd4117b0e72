"""The spiking VGG module of the ``cifar10dvs_vgg`` family (imported when a model is built)."""

import torch
from torch import nn

POOL_BEFORE = (2, 4, 6)


class SpikingVGG(nn.Module):
    """Frames ``[N, T, C, H, W]`` -> logits ``[T, N, classes]`` in multi-step mode."""

    def __init__(self, widths, in_channels=2, image_size=48, num_classes=10, dropout=0.0, tau=1.333, conv_bias=True):
        super().__init__()
        from spikingjelly.activation_based import functional, layer, surrogate
        from spikingjelly.activation_based.examples.memopt.models import VGGBlock

        neuron_args = dict(tau=tau, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m")
        blocks, channels = [], in_channels
        for i, width in enumerate(widths):
            blocks.append(VGGBlock(channels, width, 3, 1, 1, i in POOL_BEFORE, **neuron_args))
            if not conv_bias:  # BatchNorm follows: the bias would only learn rounding noise
                blocks[-1].proj_bn[-2].register_parameter("bias", None)
            channels = width
        self.features = nn.Sequential(*blocks, layer.AvgPool2d(2))
        side = image_size // 2 ** (len(POOL_BEFORE) + 1)
        head = [nn.Dropout(dropout)] if dropout > 0 else []
        self.classifier = nn.Sequential(*head, nn.Linear(channels * side * side, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        functional.set_step_mode(self, "m")

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = self.features(frames.transpose(0, 1).contiguous())
        return self.classifier(torch.flatten(x, 2))
