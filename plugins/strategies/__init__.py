"""Parallelism strategies."""
