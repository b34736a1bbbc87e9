"""The clock routing state is kept on.

Modelled queues (prefill ends, backlogs, prefill rates) are in the instances' seconds. For
vLLM those are wall seconds. A simulated fleet at time scale ``s`` works ``s`` times wall
speed, so the router's and the control plane's clocks must run at that speed too, or a
benchmark at ``s`` != 1 measures a router whose queues drain at the wrong speed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def scaled_clock(scale: float = 1.0) -> Callable[[], float]:
    """A monotonic clock that runs ``scale`` times wall speed (``scale`` > 0)."""
    if not scale > 0:
        raise ValueError(f"a clock scale must be positive, not {scale!r}")
    if scale == 1.0:
        return time.monotonic
    return lambda: time.monotonic() * scale


CLOCK_SCALE_HELP = (
    "the instances' seconds per wall second: 1 for vLLM; a simulated fleet's time scale, so "
    "modelled queues drain as fast as its instances work (benchmarks only)"
)


def parse_clock_scale(text: str) -> float:
    """``--clock-scale``'s argparse type: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value
