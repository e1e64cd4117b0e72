"""Data: one sampling and batching semantics for every strategy, and training-set augmentation."""

from snnfw.deprecation import moved_names

# 0.1.0's snnfw.data module, now snnfw.data.batches: its public names, deprecated
__getattr__ = moved_names(__name__, "snnfw.data.batches", ("InputSpec", "DatasetSpec"))
