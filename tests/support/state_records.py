"""What the tests of the shared state (``prefix_router.state.store``) build on: two instances,
a fleet change that adds one, and a store on a namespace of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from prefix_router.core.fleet import Fleet, Instance
from prefix_router.state.store import FleetRecord, StateStore
from tests.support.redis_ns import fresh_store

A = Instance("127.0.0.1", 9001)
B = Instance("127.0.0.1", 9002, weight=2)


@pytest.fixture
async def store() -> AsyncIterator[StateStore]:
    async with fresh_store() as st:
        yield st


def add(instance: Instance) -> Callable[[FleetRecord], FleetRecord]:
    """A fleet change that adds ``instance``."""

    def change(record: FleetRecord) -> FleetRecord:
        return FleetRecord(Fleet.of([*record.fleet.instances, instance]), record.removing)

    return change
