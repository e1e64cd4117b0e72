"""What the checkpoint digests cost a save: the full VGG's state saved with and without them, alternately.

    python benchmark/checkpoint_digest.py [--rounds 3] [--flavor full]

In one process (``none``, one step taken so the optimizer holds its state),
each round saves synchronously with digests and without (DCP's plain writer,
``meta.json`` unsealed), then with ``checkpoint.async_save``: the time the save
holds training up (staging) and the time until the checkpoint is in place
(``finish``, which waits for the background write and its digests). Prints the
medians and their ratios, with / without, and the time of the digests alone
(the written files hashed again, from the page cache).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
import warnings
from pathlib import Path

import attrs

import snnfw
from snnfw.components import checkpoint, integrity
from snnfw.config import CheckpointConfig
from snnfw.testing import tiny_config


PLAIN = types.SimpleNamespace(DigestingWriter=integrity.FileSystemWriter, seal=lambda folder, meta: meta)


def _digests(on: bool) -> None:
    """Digests on (as shipped) or off: DCP's own writer, and meta.json without them."""
    checkpoint.integrity = integrity if on else PLAIN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flavor", default="full")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = tiny_config("none", model={"flavor": args.flavor}, data={"batch_size": 2}, train={"steps": 1})
    times = {(mode, digest): [] for mode in ("sync", "async_block", "async_total") for digest in (True, False)}
    with tempfile.TemporaryDirectory() as folder, snnfw.start(config) as run:
        run.step(0)
        for step in range(1, args.rounds + 1):
            for digest in (True, False) if step % 2 else (False, True):
                _digests(digest)
                for background in (False, True):
                    saving = attrs.evolve(config, checkpoint=CheckpointConfig(1, keep=1, async_save=background))
                    saves = checkpoint.Checkpoints(Path(folder) / f"{digest}{background}", saving, 0)
                    started = time.perf_counter()
                    saves.save(run.trainer, step, 0.0)
                    held = time.perf_counter() - started
                    saves.finish()
                    total = time.perf_counter() - started
                    if background:
                        times["async_block", digest].append(held)
                        times["async_total", digest].append(total)
                    else:
                        times["sync", digest].append(total)
        _digests(True)
        files = [p for p in (Path(folder) / "TrueFalse").rglob("*") if p.is_file() and p.name != "meta.json"]
        hashing = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for path in files:
                integrity.file_digest(path)
            hashing.append(time.perf_counter() - started)
        state = sum(p.stat().st_size for p in files)
    print(f"{args.flavor} VGG, {state / 1e6:.1f} MB written, median of {args.rounds} rounds; their digests alone "
          f"{statistics.median(hashing) * 1e3:.0f} ms:")
    for mode in ("sync", "async_block", "async_total"):
        on, off = statistics.median(times[mode, True]), statistics.median(times[mode, False])
        print(f"  {mode}: {on * 1e3:.0f} ms with digests, {off * 1e3:.0f} ms without, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
