"""Distributed primitives: process group and mesh, collectives with timeouts, the global gradient norm, BatchNorm statistics, pipeline helpers."""
