"""The Redis script's prefill queues do :mod:`prefix_router.core.work`'s arithmetic.

Each instance's queue lives in Redis as packed float64s (``redis_lua.QUEUE_FORMAT``) that
the script edits by binary search; the in-process store keeps the same queue as a tuple
through :func:`~prefix_router.core.work.admit` and :func:`~prefix_router.core.work.finished`.
Here random sequences of admits and early releases run through the real script on a real
Redis, and after each one the queue Redis returns must be the one ``core.work`` computes
from the same inputs (the script's clock as ``now``, which its reply carries).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_router.core.work import InstanceWork, admit, finished
from prefix_router.state.routing import redis_lua
from prefix_router.state.routing.redis_lua import SYNC, SyncArgs, queue_ahead, unpack_reply
from tests.conftest import REDIS_URL

ID = "10.0.0.1:8000"
RATE = 1000.0

# One operation: ("admit", decided late by s, prefill seconds) or ("release", end offset s).
# Times sit at least 0.25 s from the script's clock, so which ends have passed does not
# depend on the microseconds between the calls (nor on the 14 digits ``now`` comes back in).
admits = st.tuples(
    st.just("admit"), st.sampled_from([0.0, 100.25]), st.integers(1, 30).map(lambda k: k + 0.5)
)
releases = st.tuples(st.just("release"), st.integers(-3, 40).map(lambda k: k + 0.5), st.just(0.0))
operations = st.lists(st.one_of(admits, releases), min_size=1, max_size=25)


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    yield c
    c.close()


def keys(namespace: str) -> list[str]:
    return [f"{namespace}{k}" for k in redis_lua.KEYS]


def sync(client: redis.Redis, namespace: str, args: SyncArgs) -> tuple[float, float, bytes]:
    """One round trip; the script's ``now``, then the instance's ``busy_until`` and queue."""
    args.instances = [ID]
    reply = client.eval(SYNC, len(redis_lua.KEYS), *keys(namespace), args.pack())
    now, read, _, _ = unpack_reply(reply, 1)
    busy, _, _, queue = read[0]
    return float(now), float(busy), queue


def stored(queue: bytes) -> tuple[float, ...]:
    return queue_ahead(queue, float("-inf"))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations, keep=st.sampled_from([1, 3, 256]))
def test_the_scripts_queue_is_core_works_queue(
    client: redis.Redis, namespace: str, ops: list[tuple[str, float, float]], keep: int
) -> None:
    ns = f"{namespace}{time.monotonic_ns()}:"
    try:
        now, busy, queue = sync(client, ns, SyncArgs())
        expected = InstanceWork(busy, stored(queue), 0.0)
        for kind, a, b in ops:
            before = expected
            if kind == "admit":
                decided_at = now - a  # a write that reached Redis late: queued as of then
                args = SyncArgs(
                    admits=[(ID, decided_at, b * RATE, 0.0, RATE, "placed", "", "")], keep=keep
                )
                client.hincrby(f"{ns}share", ID, 1)  # as the reserve before it did
                now, busy, queue = sync(client, ns, args)
                # the script drops the ends passed by its own clock, then core.work queues
                # the prefill as of when it was decided
                ahead = tuple(e for e in before.ends if e > now)
                expected = admit(
                    InstanceWork(before.busy_until, ahead, 0.0),
                    decided_at,
                    prefill_tokens=b * RATE,
                    written_tokens=0.0,
                    rate=RATE,
                    keep=keep,
                )
            else:
                client.hincrby(f"{ns}share", ID, 1)
                client.hincrby(f"{ns}inflight", ID, 1)
                probe_now, _, _ = sync(client, ns, SyncArgs())
                end = probe_now + a
                now, busy, queue = sync(client, ns, SyncArgs(releases=[(ID, end)]))
                expected = finished(before, now, end)
            got = stored(queue)
            assert len(got) == len(expected.ends), (kind, got, expected.ends)
            assert got == pytest.approx(expected.ends, abs=1e-3), (kind, got, expected.ends)
            assert busy == pytest.approx(expected.busy_until, abs=1e-3)
            expected = InstanceWork(busy, got, 0.0)  # go on from what Redis holds
    finally:
        client.delete(*keys(ns))


@pytest.mark.parametrize(
    ("raw", "now", "ahead"),
    [
        (b"", 0.0, ()),
        (bytes.fromhex("3ff8000000000000"), 0.0, (1.5,)),
        (bytes.fromhex("3ff8000000000000") * 2 + bytes.fromhex("4004000000000000"), 1.5, (2.5,)),
        (bytes.fromhex("4004000000000000") + b"\x01\x02", 0.0, (2.5,)),  # a torn tail: ignored
    ],
)
def test_a_stored_queue_reads_as_the_ends_still_ahead(
    raw: bytes, now: float, ahead: tuple[float, ...]
) -> None:
    assert queue_ahead(raw, now) == ahead
