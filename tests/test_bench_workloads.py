"""Workload generators: seeded reproducibility, and prefixes shared exactly where expected."""

from __future__ import annotations

from collections import defaultdict

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


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_poisson_arrivals_at_the_rate(name: str) -> None:
    workload = generate(name, {"requests": 2000, "rate": 5.0})
    times = [a.arrival_s for a in workload]
    assert times == sorted(times) and times[0] > 0
    requests_per_s = workload.num_requests / times[-1]
    # chat: arrivals are conversations, their turns follow the answers
    if name != "chat":
        assert requests_per_s == pytest.approx(5.0, rel=0.1)


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
        common = min(common, next((i for i, (a, b) in enumerate(zip(p, versions[0], strict=False))
                                   if a != b), len(p)))
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
    assert second["messages"][len(first["messages"])] == {"role": "assistant",
                                                           "content": " ban kos"}


def test_parameters_are_checked_and_converted() -> None:
    params = make_params("rag", {"docs": "7", "skew": "0.25"})
    assert (params.docs, params.skew) == (7, 0.25)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no parameter 'dogs'"):
        make_params("rag", {"dogs": 3})
    with pytest.raises(ValueError, match="unknown workload"):
        make_params("nope")
    with pytest.raises(ValueError):
        make_params("rag", {"requests": 0})
