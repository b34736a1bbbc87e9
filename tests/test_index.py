"""The prefix index's entries: what a lookup finds, what a record writes, what it replaces."""

from __future__ import annotations

import struct

import pytest

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Fleet, Instance
from prefix_router.core.index import (
    SLOT_BYTES,
    STAMP_MASK,
    STAMP_TOKENS,
    WAYS,
    CacheModel,
    EntryWrite,
    InProcessIndex,
    apply,
    entries,
    identity_tag,
    locate,
    match,
    record,
    stamp_of,
)
from prefix_router.core.table import RoutingTable

A, B, C, GONE = 11, 22, 33, 44
MODELS = {
    A: CacheModel.of(written_tokens=160_000, capacity_tokens=100_000),
    B: CacheModel.of(written_tokens=50_000, capacity_tokens=100_000),
    C: CacheModel.of(written_tokens=0, capacity_tokens=100_000),
}


def slot(*ways: tuple[int, int, int]) -> bytes:
    padded = list(ways) + [(0, 0, 0)] * (WAYS - len(ways))
    return b"".join(struct.pack(">HHI", *w) for w in padded)


def fresh(tag: int, back_tokens: int = 0) -> int:
    """A stamp ``back_tokens`` before the instance's current one."""
    return (MODELS[tag].stamp - back_tokens // STAMP_TOKENS) & STAMP_MASK


def test_a_holder_is_as_deep_as_its_deepest_fresh_entry() -> None:
    slots = [slot((A, 1, fresh(A)), (B, 1, fresh(B))), slot((A, 2, fresh(A))), slot((B, 9, 0))]
    found = match(slots, [1, 2, 3], MODELS.get)
    assert found.depths == {A: 2, B: 1} and found.common == 0


def test_entries_of_other_blocks_departed_or_evicted_instances_do_not_count() -> None:
    slots = [
        slot(
            (A, 7, fresh(A)),  # another block in the same slot
            (GONE, 1, 0),  # not in the fleet
            (A, 1, fresh(A, 100_000)),  # A wrote its whole cache since: evicted
            (B, 1, fresh(B, 99_000)),  # B still holds it
        )
    ]
    assert match(slots, [1], MODELS.get).depths == {B: 1}


def test_a_block_every_way_holds_is_common_to_the_fleet() -> None:
    full = slot(*[(t, 5, fresh(t)) for t in (A, B, C)], (A, 5, fresh(A)))
    assert match([full, full, slot()], [5, 5, 6], MODELS.get).common == 2


@pytest.mark.parametrize(
    ("existing", "force", "expected_way"),
    [
        ([], False, 0),  # empty slot: the first way
        ([(B, 1, fresh(B)), (GONE, 3, 0)], False, 2),  # an empty way before a departed one
        ([(B, 1, fresh(B)), (GONE, 3, 0), (C, 1, 0), (A, 2, fresh(A))], False, 1),  # departed
        # all live: the most turned-over (B wrote 40% of its cache since, A 10%, C 0%)
        ([(A, 2, fresh(A, 10_000)), (B, 2, fresh(B, 40_000)), (C, 2, 0), (A, 3, 0)], False, 3),
        ([(A, 1, fresh(A, 30_000))], False, 0),  # its own entry, over a quarter stale: refresh
        ([(A, 1, fresh(A, 10_000))], True, 0),  # the deepest block is always refreshed
    ],
)
def test_record_writes_its_entry_into_the_stalest_way(
    existing: list[tuple[int, int, int]], force: bool, expected_way: int
) -> None:
    before = slot(*existing)
    write = record(7, before, 1, A, MODELS[A], MODELS.get, force=force)
    assert write is not None and write.way == expected_way
    assert write.expected == before[expected_way * 8 : expected_way * 8 + 8]
    assert entries(apply(before, write))[expected_way] == (A, 1, MODELS[A].stamp)


def test_a_recent_entry_of_its_own_needs_no_write() -> None:
    assert record(7, slot((A, 1, fresh(A, 10_000))), 1, A, MODELS[A], MODELS.get) is None
    assert record(7, slot((A, 1, fresh(A))), 1, A, MODELS[A], MODELS.get, force=True) is None


def test_a_write_applies_only_if_the_entry_still_holds_what_was_read() -> None:
    index = InProcessIndex(slots_log2=10)
    first = EntryWrite(3, 1, bytes(8), struct.pack(">HHI", A, 1, 5))
    index.write(first)
    stale = EntryWrite(3, 1, bytes(8), struct.pack(">HHI", B, 1, 5))  # read before `first`
    index.write(stale)
    assert entries(index.read(3))[1] == (A, 1, 5) and len(index.read(3)) == SLOT_BYTES


def test_stamps_wrap_and_still_compare() -> None:
    model = CacheModel.of(written_tokens=STAMP_TOKENS * (STAMP_MASK + 10), capacity_tokens=1000)
    assert model.stamp == 9
    assert model.is_fresh((9 - 10) & STAMP_MASK) and not model.is_fresh(9 - 1000)
    assert stamp_of(STAMP_TOKENS * 3.5) == 3


def test_locate_and_tags_fit_their_fields() -> None:
    slot_index, fp = locate(0xFFFF_0000_0000_ABCD, 18)
    assert slot_index == 0x3FFFC and fp == 0xABCD
    assert all(1 <= identity_tag(f"10.0.0.{i}:8000") <= 0xFFFF for i in range(200))


def by_ring_key(instance: Instance) -> str:
    return instance.ring_key


def colliding_pair() -> tuple[Instance, Instance]:
    """Two instances whose identity tags collide (about 3% of 64-instance fleets have one)."""
    seen: dict[int, str] = {}
    for n in range(100_000):
        address = f"10.{n // 62_500}.{(n // 250) % 250}.{n % 250 + 1}"
        tag = identity_tag(f"{address}:8000")
        if tag in seen:  # in ring-key order: the first keeps the plain tag
            pair = sorted([Instance(seen[tag], 8000), Instance(address, 8000)], key=by_ring_key)
            return pair[0], pair[1]
        seen[tag] = address
    raise AssertionError("no collision in 100,000 addresses")


def test_an_instance_keeps_its_tag_while_the_one_it_collides_with_is_unhealthy() -> None:
    """Tags are settled over the whole fleet: the later of two colliding instances keeps
    its rehashed tag when the other only goes unhealthy, else the prefix index's entries
    of each would pass to the other with every health flip."""
    first, second = colliding_pair()
    other = Instance("192.168.9.9", 8000)
    healthy = RoutingTable.build(Fleet.of([first, second, other]), RouterConfig())
    flipped = RoutingTable.build(
        Fleet.of([first.with_changes(healthy=False), second, other]), RouterConfig()
    )
    tag = dict(zip(healthy.ids, healthy.tags, strict=True))
    assert tag[first.id] != tag[second.id]
    assert dict(zip(flipped.ids, flipped.tags, strict=True)) == {
        second.id: tag[second.id],
        other.id: tag[other.id],
    }
