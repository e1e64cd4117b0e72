"""Train a SpikingJelly network of your own under any snnfw strategy, in your own loop.

    torchrun --nproc_per_node=2 examples/train_own_model.py --strategy fsdp2
    python examples/train_own_model.py --strategy none          # one process

The network below is plain SpikingJelly in multi-step mode, taking ``[T, N, C,
H, W]`` (``input_layout = "TN"``), with SEW-ResNet's residual ADD. Nothing is
declared for the strategies: snnfw infers the FSDP2 units (the children with
parameters), the pipeline units (the children of the ``nn.Sequential``) and
the tensor-parallel plan (each Conv-BN-LIF container is ``conv_bn_neuron``,
whose output is whole, so the residual add is safe). ``snnfw plan`` shows
what it inferred. The same model and data train with ``snnfw train
examples/own_model.toml``, which names ``build`` and ``datasets`` below.
"""

import argparse
import json

import torch
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from torch import nn

import snnfw

TIME_STEPS, FRAME, CLASSES = 4, (2, 16, 16), 10


def conv_bn_lif(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        layer.Conv2d(channels_in, channels_out, 3, padding=1, bias=False),
        layer.BatchNorm2d(channels_out),
        neuron.LIFNode(tau=2.0, detach_reset=True, surrogate_function=surrogate.ATan()),
    )


class SEWBlock(nn.Module):
    """``conv(x) + x``: SEW-ResNet's ADD connection around a Conv-BN-LIF unit."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv_bn_lif(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + x


def build(channels: int = 16) -> nn.Module:
    """The network: stem, two SEW blocks with pooling between, and a linear read-out per time step."""
    net = nn.Sequential(
        conv_bn_lif(FRAME[0], channels),
        SEWBlock(channels),
        layer.MaxPool2d(2),
        SEWBlock(channels),
        layer.AdaptiveAvgPool2d(2),
        layer.Flatten(),
        layer.Linear(channels * 4, CLASSES),
    )
    functional.set_step_mode(net, "m")
    return net


def datasets():
    """(train, test): any map-style Datasets of (frames [T, C, H, W], label); here snnfw's moving DVS blobs."""
    from snnfw.api import InputSpec, registered_datasets

    spec = InputSpec(TIME_STEPS, FRAME, CLASSES)
    return registered_datasets("synthetic_dvs", spec, seed=1, train_samples=1024, test_samples=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="dp", help="none, dp, zero, fsdp2, tp, fsdp2_tp, pp or auto")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", help="write the per-step losses and the test accuracy to this JSON file")
    parser.add_argument("--run-dir", help="write metrics.jsonl, summary.json and progress lines as snnfw train does")
    parser.add_argument("--export", help="save the trained weights (a plain state dict of build()'s model) here")
    args = parser.parse_args()
    config = {
        "model": {"input_shape": list(FRAME), "num_classes": CLASSES, "time_steps": TIME_STEPS, "input_layout": "TN"},
        "data": {"batch_size": 32},
        "parallel": {"strategy": args.strategy},
        "train": {"steps": args.steps, "lr": 3e-3, "optimizer": "adamw", "lr_schedule": "cosine", "warmup_steps": 5},
    }
    train, test = datasets()
    with snnfw.start(config, model=build, train_set=train, test_set=test, run_dir=args.run_dir) as run:
        losses = [run.step(step)["loss"] for step in range(run.start_step, run.config.train.steps)]  # progress on rank 0
        accuracy = run.evaluate()["eval_acc"]
        if args.export:
            run.export(args.export)
        if run.rank == 0:
            print(f"{run.plan.name} on {run.plan.world_size} rank(s): test accuracy {accuracy:.1%}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"losses": losses, "test_accuracy": accuracy}, f)


if __name__ == "__main__":
    main()
