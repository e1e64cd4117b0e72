"""Data: one sampling and batching semantics for every strategy, and training-set augmentation."""
