"""SOPs, ANN MACs and the energy ratio of a family's network on one batch of synthetic data, beside SpikingJelly's
SynOpCounter on the same forward pass.

    python benchmark/synaptic_ops.py --family cifar10dvs_vgg --flavor full --batch 4
    python benchmark/synaptic_ops.py --family spikformer --flavor tiny --batch 4
"""

import argparse

import torch

from snnfw.components.ops import OpCounter, table
from snnfw.config import build_config
from snnfw.data import batches as datalib
from snnfw.plan.prepare import build_datasets, prepare
from snnfw.plugin.manager import Plugins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="cifar10dvs_vgg")
    parser.add_argument("--flavor", default="full")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--time-steps", type=int, default=4)
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="keep the initial BatchNorm statistics (most layers then stay silent)")
    args = parser.parse_args()
    from spikingjelly.activation_based import functional
    from spikingjelly.activation_based.op_counter import DispatchCounterMode, SynOpCounter

    config = build_config({"model": {"family": args.family, "flavor": args.flavor, "time_steps": args.time_steps},
                           "data": {"name": "synthetic_dvs", "test_samples": args.batch}})
    plugins = Plugins()
    prepared = prepare(config, 1, plugins)
    model = prepared.model.eval()
    frames, _ = datalib.load(build_datasets(config, prepared.spec, plugins)[1], torch.arange(args.batch),
                             torch.device("cpu"))
    if args.calibrate:  # BatchNorm statistics of this batch, as a trained network's would be of its data
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # one pass: the batch's own statistics
        with torch.no_grad():
            model.train()(frames)
        functional.reset_net(model)
        model.eval()
    counter = OpCounter(model, args.time_steps, config.eval.energy_ac_pj, config.eval.energy_mac_pj)
    counter.counting(True)
    theirs = SynOpCounter()
    with torch.no_grad(), DispatchCounterMode([theirs]):
        model(frames)
    counter.take(keep=True)
    counted = counter.totals(args.batch)
    functional.reset_net(model)
    result = {**{k: v for k, v in counted.items() if k != "layers"}, "layer_ops": counted["layers"],
              "ops_samples": args.batch, "energy_ac_pj": counter.energy_ac_pj, "energy_mac_pj": counter.energy_mac_pj}
    calibrated = ", BatchNorm statistics of the batch" if args.calibrate else ""
    print(f"{args.family} {args.flavor}, T = {args.time_steps}, {args.batch} synthetic_dvs samples, initial weights"
          f"{calibrated}")
    print(table(result))
    ours = sum(layer["sops"] for layer in counted["layers"].values())
    root = type(model).__name__
    for name, layer in counted["layers"].items():
        sj = sum(theirs.records.get(f"{root}.{name}", {}).values())
        if sj != layer["sops"]:
            print(f"  {name}: snnfw {layer['sops']:,} SOPs, SynOpCounter {sj:,}")
    print(f"SOPs over the batch: snnfw {ours:,}, SpikingJelly's SynOpCounter {theirs.get_total():,} "
          f"(over every convolution and matmul of 0/1 operands, layers or not)")


if __name__ == "__main__":
    main()
