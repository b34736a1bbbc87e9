"""Each instance's modelled prefill queue: first come, first served, at its own rate."""

from __future__ import annotations

import pytest

from prefix_router.core.work import MAX_WAITING_TRACKED, InstanceWork, admit, finished


def test_prefill_queues_behind_what_is_queued_and_drains_with_time() -> None:
    w = admit(InstanceWork(), 10.0, prefill_tokens=2000, written_tokens=2256, rate=1000)
    w = admit(w, 10.5, prefill_tokens=1000, written_tokens=1000, rate=1000)
    assert w.ends == (12.0, 13.0) and w.busy_until == 13.0 and w.written_tokens == 3256
    assert [w.backlog_s(t) for t in (10.5, 12.5, 14.0)] == [2.5, 0.5, 0.0]
    assert [w.waiting(t) for t in (10.5, 12.0, 12.5, 13.0)] == [2, 1, 1, 0]


def test_an_idle_instance_starts_a_request_at_once() -> None:
    w = admit(
        InstanceWork(busy_until=5.0, ends=(5.0,)),
        9.0,
        prefill_tokens=500,
        written_tokens=0,
        rate=1000,
    )
    assert w.ends == (9.5,) and w.backlog_s(9.0) == pytest.approx(0.5)


def test_the_waiting_list_is_bounded() -> None:
    w = InstanceWork()
    for _ in range(MAX_WAITING_TRACKED + 50):
        w = admit(w, 0.0, prefill_tokens=1, written_tokens=1, rate=1000)
    assert len(w.ends) == MAX_WAITING_TRACKED and w.waiting(0.0) == MAX_WAITING_TRACKED


def test_only_the_last_keep_ends_are_kept() -> None:
    w = InstanceWork()
    for _ in range(10):
        w = admit(w, 0.0, prefill_tokens=1, written_tokens=1, rate=1000, keep=4)
    assert w.ends == pytest.approx((0.007, 0.008, 0.009, 0.010)) and w.waiting(0.0) == 4
    w = admit(w, 0.0095, prefill_tokens=1, written_tokens=1, rate=1000, keep=4)
    assert w.ends == pytest.approx((0.010, 0.011))


def test_a_request_that_finished_proves_the_prefill_before_it_done() -> None:
    w = InstanceWork()
    for _ in range(4):  # four requests of 1 s of prefill each, all routed at 0
        w = admit(w, 0.0, prefill_tokens=1000, written_tokens=0, rate=1000)
    assert w.busy_until == 4.0 and w.waiting(0.5) == 4
    # the second ended at 0.5 s (the backend is faster than modelled): two remain, 2 s of work
    w = finished(w, 0.5, 2.0)
    assert w.busy_until == 2.5 and w.ends == (1.5, 2.5) and w.waiting(0.5) == 2
    assert finished(w, 9.0, 2.0) == w  # a request the model had already finished
