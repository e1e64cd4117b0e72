"""Data sets."""
