"""The benchmark scripts' shared helpers that need no stack."""

from __future__ import annotations

import datetime
import re

from bench.scripts._harness import run_heading


def test_a_run_heading_names_when_and_which_commit() -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.UTC)
    heading = run_heading(when)
    assert re.fullmatch(r"### Run of 2026-01-02 03:04 UTC at [0-9a-f]{7,40}\+?", heading), heading
