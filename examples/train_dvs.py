"""Train on CIFAR10-DVS, DVS128 Gesture or N-MNIST under any strategy, from raw recordings or SpikingJelly's frames.

``--root`` is a folder of the raw recordings as their publishers ship them
(CIFAR10-DVS's ``<class>/*.aedat``, DVS128 Gesture's ``DvsGesture/``,
N-MNIST's ``Train/`` and ``Test/``), which tonic integrates into frames of the
recipe's T once and caches in ``ROOT/.snnfw-frames``; or the root given to
SpikingJelly's data set class, which wrote its frames there::

    python -c "from spikingjelly.datasets.cifar10_dvs import CIFAR10DVS as D; \\
               D('data/cifar10dvs', data_type='frame', frames_number=10, split_by='number')"

Then, from the repository root::

    torchrun --nproc_per_node=2 examples/train_dvs.py --recipe cifar10dvs_vgg_tet --root data/cifar10dvs --strategy dp

The recipes are ``examples/recipes/*.toml`` (network, optimizer, schedule,
loss, augmentation and epochs, with the publication each follows); ``--set
section.key=value`` changes any key (``data.frames`` how raw events become
frames). Frames are resized by area to the model's input. Every
``eval.every_epochs`` epochs the model is scored on the whole test split; with ``--run-dir`` a checkpoint is written then (``--resume``
continues from the newest), with the model of the best validation and the
final one.
"""

import argparse
from pathlib import Path

import snnfw
from snnfw.api import load_config

RECIPES = Path(__file__).resolve().parent / "recipes"
DVS_RECIPES = ("cifar10dvs_vgg_tet", "dvs128_gesture", "n_mnist_plif")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=DVS_RECIPES, default="cifar10dvs_vgg_tet")
    parser.add_argument("--root", required=True, help="the raw recordings, or the root given to SpikingJelly's data set class")
    parser.add_argument("--strategy", default="dp", help="none, dp, zero, fsdp2, tp, fsdp2_tp, pp or auto")
    parser.add_argument("--run-dir", type=Path, help="checkpoints, the best and the final model")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a key of the recipe")
    args = parser.parse_args()
    config = load_config(RECIPES / f"{args.recipe}.toml",
                         [f"data.root={args.root}", f"parallel.strategy={args.strategy}", *args.set])
    with snnfw.start(config, run_dir=args.run_dir, resume=args.resume) as run:
        main_rank, epochs = run.env.rank == 0, run.config.train.epochs
        per_epoch = run.config.train.steps // epochs
        every = run.config.eval.every or per_epoch  # the recipe's eval.every_epochs, in steps
        best = -1.0  # the first validation is the best so far
        for step in range(run.start_step, run.config.train.steps):
            record = run.step(step)
            if (step + 1) % every:
                continue
            scores = run.evaluate()
            if main_rank:
                print(f"epoch {(step + 1) // per_epoch}/{epochs}: loss {record['loss']:.4f}, "
                      f"train acc {record['train_acc']:.1%}, test acc {scores['eval_acc']:.1%}, "
                      f"spikes {record['spike_rate']:.1%}", flush=True)
            if args.run_dir:
                run.save(step + 1, record["loss"])
                if scores["eval_acc"] > best:
                    run.export(args.run_dir / "best_model.pt")
            best = max(best, scores["eval_acc"])
        if args.run_dir:
            run.export(args.run_dir / "final_model.pt")
        if main_rank:
            print(f"{run.plan.name} on {run.plan.world_size} rank(s): best test accuracy {best:.1%}")


if __name__ == "__main__":
    main()
