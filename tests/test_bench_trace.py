"""Trace replay: both timestamp forms, prefixes as chains of hash ids, lengths, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace import (
    TraceError,
    TraceOptions,
    load_trace,
    parse_records,
    parse_timestamp,
)


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts(path: Path, **options: object) -> list[str]:
    workload = load_trace(path, TraceOptions(**options))  # type: ignore[arg-type]
    return [a.turns[0].prompt or "" for a in workload]


def test_milliseconds_and_unix_nanoseconds_give_the_same_arrivals(tmp_path: Path) -> None:
    base_ns = 1_700_000_000_000_000_000
    rows = [(0, 10), (250, 11), (1250, 12)]
    ms = write(
        tmp_path / "ms.jsonl",
        [{"timestamp": t, "input_length": n, "output_length": 3, "hash_ids": [1]} for t, n in rows],
    )
    ns = write(
        tmp_path / "ns.jsonl",
        [
            {
                "timestamp": str(base_ns + t * 1_000_000),
                "input_length": n,
                "output_length": 3,
                "hash_ids": [1],
            }
            for t, n in rows
        ],
    )
    for path in (ms, ns):
        arrivals = [a.arrival_s for a in load_trace(path)]
        assert arrivals == pytest.approx([0.0, 0.25, 1.25])
    fast = [a.arrival_s for a in load_trace(ms, TraceOptions(speedup=5))]
    assert fast == pytest.approx([0.0, 0.05, 0.25])
    assert parse_timestamp(1500) == 1.5
    assert parse_timestamp("2000000000") == 2.0
    with pytest.raises(TraceError):
        parse_timestamp(True)


def test_prompts_agree_exactly_as_far_as_their_hash_ids(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 48, "output_length": 1, "hash_ids": [7, 8, 9]},
            {"timestamp": 1, "input_length": 48, "output_length": 1, "hash_ids": [7, 8, 10]},
            {"timestamp": 2, "input_length": 48, "output_length": 1, "hash_ids": [5, 8, 9]},
            {"timestamp": 3, "input_length": 48, "output_length": 1, "hash_ids": [7, 8, 9]},
        ],
    )
    a, b, c, d = prompts(path, block_tokens=16)
    block = 16 * 4
    assert a == d
    assert a[: 2 * block] == b[: 2 * block] and a[2 * block :] != b[2 * block :]
    # the same id after a different prefix is different text: the prefix is the id chain
    assert a[:block] != c[:block] and a[block : 2 * block] != c[block : 2 * block]
    assert all(len(p) == 48 * 4 for p in (a, b, c, d))


def test_prompts_are_cut_or_padded_to_input_length(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 20, "output_length": 0, "hash_ids": [1, 2]},
            {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1]},
            {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1]},
        ],
    )
    short, long1, long2 = prompts(path, block_tokens=16)
    assert len(short) == 80 and len(long1) == len(long2) == 160
    assert short[:64] == long1[:64]
    assert long1[64:] != long2[64:]  # padding is unique to the request
    turns = [a.turns[0] for a in load_trace(path)]
    assert [t.max_tokens for t in turns] == [1, 5, 5]
    assert all(t.endpoint == "completion" for t in turns)


def test_bad_lines_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match="line 3"):
        list(parse_records(path.read_text().splitlines()))
    with pytest.raises(TraceError, match="line 1"):
        list(parse_records(['{"timestamp": 0, "input_length": 0, "output_length": 1}']))


def test_max_requests_and_block_size(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": i, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]}
            for i in range(10)
        ],
    )
    workload = load_trace(path, TraceOptions(max_requests=4))
    assert workload.num_requests == 4 == len(list(workload))
    mooncake = prompts(path, block_tokens=512, max_requests=1)[0]
    assert len(mooncake) == 4096
