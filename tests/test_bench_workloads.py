"""Workload generators: seeded reproducibility, and prefixes shared exactly where expected."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict

import orjson
import pytest

from bench.spec import PATHS, Arrival, Workload, request_body
from bench.workloads import WORKLOADS, generate, make_params
from prefix_router.core.config import PrefixMode
from prefix_router.core.key import KeySettings, extract_key

MODEL = "m"
KEY = KeySettings(prefix_length=1024, mode=PrefixMode.OPENAI)
SMALL = {"requests": 300, "rate": 10.0}


def bodies(workload: Workload) -> list[bytes]:
    """First-turn bodies, in arrival order."""
    return [request_body(a.turns[0], model=MODEL) for a in workload]


def key_of(arrival: Arrival) -> str:
    turn = arrival.turns[0]
    body = request_body(turn, model=MODEL)
    return extract_key(body, settings=KEY, path=PATHS[turn.endpoint]).value


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_bytes_other_seed_other_bytes(name: str) -> None:
    first, again = generate(name, SMALL), generate(name, SMALL)
    assert [a.arrival_s for a in first] == [a.arrival_s for a in again]
    assert [a.turns for a in first] == [a.turns for a in again]
    other = generate(name, {**SMALL, "seed": 2})
    assert bodies(other) != bodies(first)
    assert sum(len(a.turns) for a in first) == first.num_requests == 300


CONVERSATIONS = {"chat", "long-system-chat", "trace-like"}
"""Workloads whose arrivals are conversations (their later turns follow the answers)."""


SINGLE = sorted(set(WORKLOADS) - {"mixed"})
"""Workloads of one kind of traffic (``mixed`` superposes them)."""


@pytest.mark.parametrize("name", SINGLE)
def test_arrivals_at_the_rate(name: str) -> None:
    workload = generate(name, {"requests": 2000, "rate": 5.0})
    times = [a.arrival_s for a in workload]
    assert times == sorted(times) and times[0] > 0
    requests_per_s = workload.num_requests / times[-1]
    if name not in CONVERSATIONS:
        assert requests_per_s == pytest.approx(5.0, rel=0.1)
    else:  # conversations arrive at rate / mean turns
        assert len(times) / times[-1] == pytest.approx(5.0 * len(times) / 2000, rel=0.15)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_defaults_older_workloads_poisson_uniform_newer_heavy_tailed(name: str) -> None:
    params = make_params(name)
    new = name in ("long-system-chat", "trace-like", "group-prompts", "mixed")
    assert params.outputs == ("lognormal" if new else "uniform")
    assert params.arrivals == ("gamma" if name in ("trace-like", "mixed") else "poisson")


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise([0.0, *times])]


def dispersion(times: list[float], window: float) -> float:
    """Variance over mean of the arrivals counted in consecutive windows."""
    counts = Counter(int(t // window) for t in times)
    series = [counts.get(k, 0) for k in range(int(times[-1] // window))]
    return statistics.pvariance(series) / statistics.fmean(series)


@pytest.mark.parametrize(
    ("arrivals", "burstiness", "cv", "dispersion_range"),
    [
        ("poisson", 3.0, 1.0, (0.7, 1.4)),  # burstiness is ignored by Poisson
        ("gamma", 1.0, 1.0, (0.7, 1.4)),  # CV 1: as Poisson
        ("gamma", 2.0, 2.0, (2.5, 6.0)),  # counts vary ~4x as much
        ("gamma", 3.0, 3.0, (5.0, 14.0)),
    ],
)
def test_burstiness_is_the_gaps_variation_and_clumps_the_counts(
    arrivals: str, burstiness: float, cv: float, dispersion_range: tuple[float, float]
) -> None:
    rate = 10.0
    workload = generate(
        "unique",
        {
            "requests": 8000,
            "rate": rate,
            "arrivals": arrivals,
            "burstiness": burstiness,
            "prompt_min": 1,
            "prompt_max": 1,
        },
    )
    times = [a.arrival_s for a in workload]
    g = gaps(times)
    assert statistics.fmean(g) == pytest.approx(1 / rate, rel=0.1)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(cv, rel=0.15)
    low, high = dispersion_range
    assert low < dispersion(times, window=20 / rate) < high


@pytest.mark.parametrize(
    ("overrides", "median", "low", "high", "tail_over_median"),
    [
        ({"outputs": "uniform", "output_min": 64, "output_max": 256}, 160, 64, 256, (1.0, 1.7)),
        ({"outputs": "lognormal"}, 256, 64, 4096, (7.0, 13.0)),  # p99 ~ e^2.33 x median
        ({"outputs": "lognormal", "output_sigma": 0.0}, 256, 256, 256, (1.0, 1.0)),
        (
            {"outputs": "lognormal", "output_median": 300, "output_cap": 1000, "output_min": 1},
            300,
            1,
            1000,
            (3.0, 3.4),
        ),  # the tail is capped at 1000
    ],
)
def test_output_lengths(
    overrides: dict[str, object],
    median: int,
    low: int,
    high: int,
    tail_over_median: tuple[float, float],
) -> None:
    workload = generate("system-prompt", {"requests": 4000, **overrides})  # type: ignore[dict-item]
    outputs = sorted(a.turns[0].max_tokens for a in workload)
    assert low <= outputs[0] and outputs[-1] <= high
    assert statistics.median(outputs) == pytest.approx(median, rel=0.08)
    p99 = outputs[int(0.99 * len(outputs))]
    assert tail_over_median[0] <= p99 / statistics.median(outputs) <= tail_over_median[1]


def test_long_system_chat_shares_one_long_system_prompt_over_six_turn_conversations() -> None:
    conversations = list(generate("long-system-chat"))
    assert len(conversations) == 600
    assert {len(c.turns) for c in conversations} == {6}
    systems = {c.turns[0].messages[0] for c in conversations}
    assert len(systems) == 1
    role, text = systems.pop()
    assert role == "system" and len(text) // 4 == pytest.approx(1800, abs=10)
    firsts = {c.turns[0].messages[1][1] for c in conversations}
    assert len(firsts) == 600  # the conversations differ after it


def test_trace_like_one_block_then_diverging_heavy_tailed_conversations() -> None:
    conversations = list(generate("trace-like"))
    block = conversations[0].turns[0].messages[0][1]
    assert len(block) == 2048  # 512 tokens of 4 bytes
    assert all(c.turns[0].messages[0] == ("system", block) for c in conversations)
    heads = [request_body(c.turns[0], model=MODEL) for c in conversations]
    shared = heads[0].index(block.encode()) + len(block)
    assert all(h[:shared] == heads[0][:shared] for h in heads)
    assert len({h[shared : shared + 64] for h in heads}) == len(heads)
    turns = Counter(len(c.turns) for c in conversations)
    assert turns[1] > 0.3 * len(conversations) and max(turns) >= 8  # most short, a few long
    users = sorted(len(t.messages[-1][1]) // 4 for c in conversations for t in c.turns)
    median = statistics.median(users)
    assert median == pytest.approx(1000, rel=0.1)
    assert users[int(0.99 * len(users))] > 5 * median


def test_group_prompts_every_group_sixteen_times_with_its_own_prompt() -> None:
    arrivals = list(generate("group-prompts"))
    groups = Counter(a.group for a in arrivals)
    assert len(groups) == 128 and set(groups.values()) == {16}
    prompts: dict[str, set[str]] = defaultdict(set)
    for a in arrivals:
        prompts[a.group].add(a.turns[0].messages[0][1])
    assert all(len(p) == 1 for p in prompts.values())
    texts = [next(iter(p)) for p in prompts.values()]
    assert {len(t) for t in texts} == {4096 * 4} and len({t[:32] for t in texts}) == 128
    assert len({a.turns[0].messages[1][1] for a in arrivals}) == len(arrivals)


@pytest.mark.parametrize("name", ["system-prompt", "rag", "code", "hot-prefix", "chat"])
def test_one_prefix_key_per_group_and_a_different_one_per_group(name: str) -> None:
    keys: dict[str, set[str]] = defaultdict(set)
    for arrival in generate(name, SMALL):
        keys[arrival.group].add(key_of(arrival))
    assert all(len(k) == 1 for k in keys.values()), "a group's requests must share the key"
    distinct = {next(iter(k)) for k in keys.values()}
    assert len(distinct) == len(keys) > 1, "different prefixes must have different keys"


def test_unique_prefixes_share_nothing() -> None:
    workload = generate("unique", SMALL)
    keys = [key_of(a) for a in workload]
    assert len(set(keys)) == len(keys)
    firsts = {b[:200] for b in bodies(workload)}
    assert len(firsts) == workload.num_requests


def test_rag_questions_share_the_whole_document() -> None:
    by_doc: dict[str, list[str]] = defaultdict(list)
    for arrival in generate("rag", SMALL):
        by_doc[arrival.group].append(arrival.turns[0].messages[1][1])
    doc, contents = max(by_doc.items(), key=lambda kv: len(kv[1]))
    assert len(contents) > 5
    shared = contents[0].split("Question:")[0]
    assert len(shared) > 4 * 4000  # the whole document, in tokens of 4 bytes
    assert all(c.startswith(shared) for c in contents)
    assert len({c.split("Question:")[1] for c in contents}) == len(contents)


def test_code_requests_share_the_file_and_differ_at_the_end() -> None:
    prompts: dict[str, list[str]] = defaultdict(list)
    for arrival in generate("code", SMALL):
        assert arrival.turns[0].prompt is not None
        prompts[arrival.group].append(arrival.turns[0].prompt)
    file, versions = max(prompts.items(), key=lambda kv: len(kv[1]))
    header = f"# file: src/module_{file.split('-')[1]}.py\n"
    assert all(p.startswith(header) for p in versions)
    common = min(len(p) for p in versions)
    for p in versions:
        common = min(
            common,
            next(
                (i for i, (a, b) in enumerate(zip(p, versions[0], strict=False)) if a != b), len(p)
            ),
        )
    assert common > 4 * 2000 * 0.9  # at least the file body is shared
    assert len(set(versions)) == len(versions)  # each request has its own edit at the end


def test_hot_prefix_carries_its_share() -> None:
    workload = generate("hot-prefix", {"requests": 4000, "hot_share": 0.5})
    hot = sum(1 for a in workload if a.group == "hot")
    assert hot / 4000 == pytest.approx(0.5, abs=0.03)


def test_chat_turns_resend_the_conversation() -> None:
    workload = generate("chat", SMALL)
    conversations = list(workload)
    assert any(len(c.turns) > 1 for c in conversations)
    for c in conversations:
        assert c.turns[0].messages[0][0] == "system" and c.turns[0].think_s == 0
        assert all(t.think_s > 0 and t.messages[0][0] == "user" for t in c.turns[1:])
    c = next(c for c in conversations if len(c.turns) > 1)
    history = (*c.turns[0].messages, ("assistant", " ban kos"))
    second = orjson.loads(request_body(c.turns[1], model=MODEL, history=history))
    first = orjson.loads(request_body(c.turns[0], model=MODEL))
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assert second["messages"][len(first["messages"])] == {
        "role": "assistant",
        "content": " ban kos",
    }


def test_parameters_are_checked_and_converted() -> None:
    params = make_params("rag", {"docs": "7", "skew": "0.25"})
    assert (params.docs, params.skew) == (7, 0.25)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no parameter 'dogs'"):
        make_params("rag", {"dogs": 3})
    with pytest.raises(ValueError, match="unknown workload"):
        make_params("nope")
    with pytest.raises(ValueError):
        make_params("rag", {"requests": 0})
    with pytest.raises(ValueError, match="outputs must be one of"):
        make_params("rag", {"outputs": "pareto"})
    with pytest.raises(ValueError, match="outputs must be one of"):
        make_params("chat", {"arrivals": "hawkes"})
    with pytest.raises(ValueError, match="output_median"):
        make_params("chat", {"output_median": 10_000})


def parts_of(workload: Workload) -> dict[str, list[Arrival]]:
    out: dict[str, list[Arrival]] = defaultdict(list)
    for a in workload:
        out[a.group.split("/", 1)[0]].append(a)
    return out


def test_a_mix_sends_each_part_its_share_from_one_arrival_process() -> None:
    mix = generate(
        "mixed",
        {"requests": 6000, "rate": 8.0, "arrivals": "poisson", "parts": "rag:3,unique:1,chat:1"},
    )
    parts = parts_of(mix)
    turns = {name: sum(len(a.turns) for a in arrivals) for name, arrivals in parts.items()}
    assert sum(turns.values()) == mix.num_requests == 6000
    for name, share in (("rag", 0.6), ("unique", 0.2), ("chat", 0.2)):
        assert turns[name] / 6000 == pytest.approx(share, abs=0.03)
    times = [a.arrival_s for a in mix]
    assert times == sorted(times)
    assert 6000 / times[-1] == pytest.approx(8.0, rel=0.1)  # requests a second, turns counted
    # one process: every part keeps sending until the run ends (the window of a capacity
    # probe ends at the last arrival, and a part that had stopped would be missing from it)
    for arrivals in parts.values():
        assert arrivals[-1].arrival_s > 0.95 * times[-1]


def test_a_mix_keeps_each_parts_prefixes_and_gives_them_its_own_shape() -> None:
    overrides = {"requests": 400, "rate": 10.0, "parts": "system-prompt:1,rag:1"}
    mix = parts_of(generate("mixed", {**overrides, "pool_scale": 0.5}))
    alone = generate("system-prompt", {"requests": 200, "rate": 5.0, "prompts": 24})
    # the part is the workload itself, with the mix's shape: lognormal outputs, gamma gaps
    assert {a.turns[0].messages[0] for a in mix["system-prompt"]} <= {
        a.turns[0].messages[0] for a in alone
    }
    assert len({a.group for a in mix["system-prompt"]}) <= 24  # 48 prompts x 0.5
    assert len({a.group for a in mix["rag"]}) <= 48  # 96 documents x 0.5
    outputs = [t.max_tokens for arrivals in mix.values() for a in arrivals for t in a.turns]
    assert max(outputs) > 4 * statistics.median(outputs)  # heavy-tailed, not 64-256
    keys = {name: {key_of(a) for a in arrivals} for name, arrivals in mix.items()}
    assert not keys["system-prompt"] & keys["rag"]


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ("rag:1,nope:1", "unknown part 'nope'"),
        ("rag:1,mixed:1", "unknown part 'mixed'"),
        ("rag:x", "not a number"),
        ("rag:0", "must be > 0"),
        ("rag:nan", "must be > 0"),
        ("rag:1,rag:2", "given twice"),
        (" , ", "no parts"),
    ],
)
def test_a_mix_refuses_parts_it_cannot_build(parts: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        make_params("mixed", {"parts": parts})
