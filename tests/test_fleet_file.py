"""A fleet file's instances are typed strictly and their ring keys are distinct: a value of
the wrong shape is an error naming it, never a fleet that routes oddly once seeded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from control_plane.server import load_fleet_file
from prefix_router.core.errors import ConfigError, FleetError
from prefix_router.core.fleet import Instance, check_ring_keys, fleet_from_file


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([], ()),
        (
            [{"address": "10.0.0.5", "port": 8000, "models": ["m"], "hash_key": "gpu-a"}],
            (Instance("10.0.0.5", 8000, models=("m",), hash_key="gpu-a"),),
        ),
        ([{"address": "vllm-0", "port": "8000", "weight": 2}], (Instance("vllm-0", 8000, 2),)),
        ([{"address": "h", "port": 1, "models": None}], (Instance("h", 1),)),
    ],
)
def test_a_fleet_file_gives_these_instances(
    entries: list[Any], expected: tuple[Instance, ...]
) -> None:
    assert fleet_from_file(entries).instances == expected


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ({"address": "h", "port": 1}, "'instances' must be a list"),
        (["h:1"], "instance 0: expected a mapping"),
        ([{"address": "h"}], "address and port are required"),
        ([{"address": "h", "port": 1, "models": "llama-3-8b"}], "models must be a list"),
        ([{"address": "h", "port": 1, "models": [7]}], "model name 7 must be a string"),
        ([{"address": "h", "port": 1, "hash_key": 7}], "hash_key 7 must be a string"),
        ([{"address": "h", "port": 1, "weight": 1.5}], "weight must be a whole number"),
        ([{"address": "h", "port": True}], "port must be a whole number"),
        ([{"address": "h", "port": "80a"}], "port must be a whole number"),
        ([{"address": 10, "port": 1}], "address must be a string"),
        ([{"address": "h", "port": 1, "hashkey": "a"}], "unknown fields ['hashkey']"),
        (
            [{"address": "h", "port": 1}, {"address": "g", "port": 1, "hash_key": "h:1"}],
            "same ring key 'h:1'",
        ),
        (
            [
                {"address": "h", "port": 1, "hash_key": "x"},
                {"address": "g", "port": 1, "hash_key": "x"},
            ],
            "same ring key 'x'",
        ),
        ([{"address": "h", "port": 1}, {"address": "h", "port": 1}], "duplicate instance ids"),
    ],
)
def test_a_fleet_file_entry_of_the_wrong_shape_is_named(entries: Any, says: str) -> None:
    with pytest.raises(FleetError) as caught:
        fleet_from_file(entries)
    assert says in str(caught.value)


def test_distinct_ring_keys_pass_and_an_instance_may_name_itself() -> None:
    check_ring_keys(
        [Instance("h", 1, hash_key="h:1"), Instance("g", 1), Instance("f", 1, hash_key="a")]
    )


def test_the_control_planes_fleet_file_names_the_file_and_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("instances:\n  - {address: 10.0.0.5, port: 8000, models: llama-3-8b}\n")
    with pytest.raises(ConfigError) as caught:
        load_fleet_file(str(path))
    assert str(caught.value) == (
        f"fleet file {path}: instance 0: models must be a list of names, not 'llama-3-8b'"
    )
