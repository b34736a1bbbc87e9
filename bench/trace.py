"""Replay of JSON Lines request traces (Mooncake / LMCache style) as a workload.

One request per line (see ``shared/trace-format.md``)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is either an integer of milliseconds from the start or a string of Unix
nanoseconds; arrivals are taken relative to the first line and divided by ``speedup``.
Each entry of ``hash_ids`` is one block of ``block_tokens`` tokens. Since some traces chain
their ids and others do not, a block's text is derived from the tuple of ids up to and
including it (a running hash), never from its own id alone: two prompts are byte-identical
exactly as far as their id lists agree from the start, and never share text after they
diverge. The prompt is cut to ``input_length`` tokens (or padded with text unique to the
request when the ids cover less) and sent to ``/v1/completions`` asking for exactly
``output_length`` tokens.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.spec import Arrival, Turn, Workload
from bench.text import BYTES_PER_TOKEN, filler_bytes


class TraceError(ValueError):
    """A trace line that cannot be replayed (reported with its line number)."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceOptions:
    block_tokens: int = 512
    """Tokens per hash id (Mooncake: 512; other traces 16-32)."""
    speedup: float = 1.0
    """Divide the trace's inter-arrival times by this."""
    max_requests: int | None = None
    max_input_tokens: int | None = None
    """Cut longer prompts to this many tokens (a fleet's context limit)."""


def parse_timestamp(value: Any) -> float:
    """Seconds: integers (or floats) are milliseconds, strings are Unix nanoseconds."""
    if isinstance(value, bool):
        raise TraceError(f"timestamp must be a number or a string, not {value!r}")
    if isinstance(value, int | float):
        return float(value) / 1000.0
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value) / 1e9
    raise TraceError(f"timestamp must be milliseconds or a string of Unix ns, not {value!r}")


def parse_records(lines: Iterable[str | bytes]) -> Iterator[TraceRecord]:
    """Records with arrival times relative to the first record, in file order."""
    origin: float | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            stamp = parse_timestamp(row["timestamp"])
            ids = tuple(int(i) for i in row.get("hash_ids") or ())
            record_in, record_out = int(row["input_length"]), int(row["output_length"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"line {number}: {exc}") from None
        if record_in < 1 or record_out < 0:
            raise TraceError(f"line {number}: input_length must be >= 1, output_length >= 0")
        origin = stamp if origin is None else origin
        yield TraceRecord(stamp - origin, record_in, record_out, ids)


def block_texts(hash_ids: Iterable[int], block_bytes: int) -> Iterator[str]:
    """Filler text of each block, keyed by the chain of ids up to it."""
    chain = b""
    for block_id in hash_ids:
        chain = hashlib.blake2b(chain + str(block_id).encode(), digest_size=16).digest()
        yield filler_bytes(chain.hex(), block_bytes)


def prompt_for(record: TraceRecord, index: int, options: TraceOptions) -> str:
    """The replayed prompt of one record: its blocks' text, cut or padded to its length."""
    tokens = record.input_length
    if options.max_input_tokens is not None:
        tokens = min(tokens, options.max_input_tokens)
    size = tokens * BYTES_PER_TOKEN
    block_bytes = options.block_tokens * BYTES_PER_TOKEN
    needed = -(-size // block_bytes)
    text = "".join(block_texts(record.hash_ids[:needed], block_bytes))
    if len(text) < size:
        text += filler_bytes(f"trace-pad:{index}", size - len(text))
    return text[:size]


def load_trace(path: str | Path, options: TraceOptions | None = None) -> Workload:
    """The workload that replays the trace at ``path`` (records read now, prompts lazily)."""
    options = options or TraceOptions()
    if options.block_tokens < 1 or options.speedup <= 0:
        raise TraceError("block_tokens must be >= 1 and speedup > 0")
    with open(path, "rb") as f:
        records = list(itertools.islice(parse_records(f), options.max_requests))
    order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)
    return Workload(
        f"trace:{Path(path).name}", len(records), lambda: _arrivals(records, order, options)
    )


def _arrivals(
    records: list[TraceRecord], order: list[int], options: TraceOptions
) -> Iterator[Arrival]:
    for index in order:
        record = records[index]
        turn = Turn(
            max_tokens=max(1, record.output_length), prompt=prompt_for(record, index, options)
        )
        group = f"block-{record.hash_ids[0]}" if record.hash_ids else f"trace-{index}"
        yield Arrival(record.arrival_s / options.speedup, group, (turn,))
