"""The live driver's settings: timeouts on the instances' clock."""

from __future__ import annotations

import pytest

from bench.driver import DriverSettings


@pytest.mark.parametrize(
    ("time_scale", "timeout_s", "max_duration_s", "deadline_s"),
    [
        (1.0, 600.0, 3600.0, 600.0),
        (2.0, 600.0, 3600.0, 300.0),  # a sped-up fleet answers in half the wall time
        (0.125, 60.0, 3600.0, 480.0),  # a slowed-down one in 8x: not a timeout
        (0.05, 600.0, 3600.0, 3600.0),  # never past the run's own bound
    ],
)
def test_a_request_may_take_its_timeout_on_the_instances_clock(
    time_scale: float, timeout_s: float, max_duration_s: float, deadline_s: float
) -> None:
    settings = DriverSettings(
        base_url="http://127.0.0.1:1",
        model="m",
        time_scale=time_scale,
        request_timeout_s=timeout_s,
        max_duration_s=max_duration_s,
    )
    assert settings.request_deadline_s == deadline_s
