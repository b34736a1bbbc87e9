"""Figures the reliability tests measure, printed for docs/reliability.md (``pytest -s``)."""

from __future__ import annotations


def report(scenario: str, **figures: object) -> None:
    print(f"\nRELIABILITY {scenario}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
