"""Each instance's modelled prefill queue: first come, first served, at its own rate."""

from __future__ import annotations

import pytest

from prefix_router.core.work import (
    MAX_WAITING_TRACKED,
    InstanceModel,
    InstanceWork,
    admit,
    finished,
    model_of_text,
    model_text,
    rates_by_group,
)


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


@pytest.mark.parametrize(
    ("text", "now", "model"),
    [
        ("12000 460000", 0.0, InstanceModel(12000.0, 460000.0)),  # no scrape of waiting
        ("12000 460000 7 100.000", 105.0, InstanceModel(12000.0, 460000.0, 7)),
        ("12000 460000 7 100.000", 110.0, InstanceModel(12000.0, 460000.0, 7)),
        ("12000 460000 7 100.000", 110.5, InstanceModel(12000.0, 460000.0)),  # stale
        ("12000 460000 7 100.000", 99.0, InstanceModel(12000.0, 460000.0)),  # future
        ("12000 460000 -3 100", 100.0, InstanceModel(12000.0, 460000.0)),
        ("12000 460000 x 100", 100.0, InstanceModel(12000.0, 460000.0)),
        ("0 0 9 100", 100.0, InstanceModel(0.0, 0.0, 9)),
        ("-5 nan", 0.0, InstanceModel(0.0, 0.0)),
        ("fast big", 0.0, InstanceModel(0.0, 0.0)),
        ("", 0.0, InstanceModel(0.0, 0.0)),
        (b"1 2 3 4", 4.0, InstanceModel(1.0, 2.0, 3)),
    ],
)
def test_a_published_model_reads_back_and_a_stale_waiting_count_is_dropped(
    text: str | bytes, now: float, model: InstanceModel
) -> None:
    assert model_of_text(text, now) == model


def test_a_model_round_trips_through_its_text() -> None:
    model = InstanceModel(11800.0, 1_000_000.0, 12)
    assert model_of_text(model_text(model, 50.0), 51.0) == model
    assert model_of_text(model_text(model, None), 51.0) == InstanceModel(11800.0, 1_000_000.0)


def test_the_instance_reported_waiting_count_only_raises_the_routers_own() -> None:
    work = admit(InstanceWork(), 0.0, prefill_tokens=1000, written_tokens=0, rate=1000)
    assert InstanceModel(1000.0, 1.0, 0).waiting_with(work, 0.5) == 1
    assert InstanceModel(1000.0, 1.0, 5).waiting_with(work, 0.5) == 5
    assert InstanceModel(1000.0, 1.0, 5).waiting_with(work, 2.0) == 5


BIG, SMALL = frozenset({"llama-70b"}), frozenset({"llama-8b"})


@pytest.mark.parametrize(
    ("learned", "groups", "expected"),
    [
        # one model: every instance gets the fleet's median, the idle one (None) too
        (
            {"a": 9000.0, "b": 12000.0, "c": 3000.0, "d": None},
            dict.fromkeys("abcd", BIG),
            dict.fromkeys("abcd", 9000.0),
        ),
        # an instance in no group is alone: its own rate, else the fleet's median
        (
            {"a": 9000.0, "b": 12000.0, "c": 3000.0, "d": None},
            {},
            {"a": 9000.0, "b": 12000.0, "c": 3000.0, "d": 9000.0},
        ),
        # two models: each pool its own median; one unlearned instance takes its pool's
        (
            {"a": 11000.0, "b": 12000.0, "c": 13000.0, "s1": 30000.0, "s2": None},
            {"a": BIG, "b": BIG, "c": BIG, "s1": SMALL, "s2": SMALL},
            {"a": 12000.0, "b": 12000.0, "c": 12000.0, "s1": 30000.0, "s2": 30000.0},
        ),
        # a pool with nothing learned yet falls back to the whole fleet's median
        (
            {"a": 10000.0, "b": 14000.0, "s1": None},
            {"a": BIG, "b": BIG, "s1": SMALL},
            {"a": 12000.0, "b": 12000.0, "s1": 12000.0},
        ),
        # nothing learned anywhere: 0, the config's default applies
        ({"a": None, "b": 0.0}, {"a": BIG, "b": BIG}, {"a": 0.0, "b": 0.0}),
    ],
)
def test_each_instance_takes_the_median_rate_of_the_instances_serving_its_models(
    learned: dict[str, float | None],
    groups: dict[str, frozenset[str]],
    expected: dict[str, float],
) -> None:
    assert rates_by_group(learned, groups) == expected
