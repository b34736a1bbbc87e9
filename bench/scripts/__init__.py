"""Measurement scripts, each runnable as ``python -m bench.scripts.NAME`` (or by path)."""
