"""Train Spikformer-4-384 on CIFAR-10 under any strategy, with the recipe of examples/recipes/spikformer_cifar10.toml.

    torchrun --nproc_per_node=4 examples/train_spikformer_cifar10.py --root data/cifar-10-batches-bin --strategy fsdp2

``--root`` is the binary version of CIFAR-10 (``cifar-10-batches-bin`` from
https://www.cs.toronto.edu/~kriz/cifar.html: ``data_batch_1.bin`` ...
``test_batch.bin``); images are rate-coded into T binary frames. The recipe
(AdamW, cosine schedule after a warmup, label smoothing, random crop and
flip) and the publication it follows are in the TOML file; ``--set
section.key=value`` changes any key. Every ``eval.every_epochs`` epochs the
model is scored on the whole test split, and the best and final models are
saved in ``--run-dir``.
"""

import argparse
from pathlib import Path

import snnfw
from snnfw.api import load_config

RECIPE = Path(__file__).resolve().parent / "recipes" / "spikformer_cifar10.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="the folder of CIFAR-10's binary batches")
    parser.add_argument("--strategy", default="fsdp2", help="none, dp, zero, fsdp2, tp, fsdp2_tp, pp or auto")
    parser.add_argument("--run-dir", type=Path, help="the best and the final model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a key of the recipe")
    args = parser.parse_args()
    config = load_config(RECIPE, [f"data.root={args.root}", f"parallel.strategy={args.strategy}", *args.set])
    with snnfw.start(config) as run:
        main_rank, steps = run.env.rank == 0, run.config.train.steps
        every = run.config.eval.every or steps  # the recipe's eval.every_epochs, in steps
        best = (-1.0, 0)  # (eval_acc, step): the first validation is the best so far
        for step in range(steps):
            record = run.step(step)
            if (step + 1) % every and step + 1 < steps:
                continue
            scores = run.evaluate()
            if main_rank:
                print(f"step {step + 1}, epoch {record['epoch']:.0f}: loss {record['loss']:.4f}, lr {record['lr']:.2e}, "
                      f"test acc {scores['eval_acc']:.1%} (top-5 {scores['eval_acc5']:.1%})", flush=True)
            if scores["eval_acc"] > best[0]:
                best = (scores["eval_acc"], step + 1)
                if args.run_dir:
                    run.export(args.run_dir / "best_model.pt")
        if args.run_dir:
            run.export(args.run_dir / "final_model.pt")
        if main_rank:
            print(f"{run.plan.name} on {run.plan.world_size} rank(s): best test accuracy {best[0]:.1%} at step {best[1]}")


if __name__ == "__main__":
    main()
