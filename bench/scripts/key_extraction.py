"""Micro-benchmark of prefix key extraction (the pure function on ext_proc's hot path).

    python bench/scripts/key_extraction.py

Prints the median time per call for 1 KB, 64 KB and 1 MB OpenAI chat bodies in
both modes (target: <= 50 us for a 64 KB chat body in openai mode), then for the
bodies whose cost grows with their size: a large base64 image, and many small
messages, on both sides of ``openai_max_parse_bytes`` (4 MiB).
"""

from __future__ import annotations

import base64
import json
import random
import statistics
import time

from bench.scripts._harness import chat_body
from prefix_router.core.config import PrefixMode
from prefix_router.core.key import KeySettings, extract_key


def per_call_us(body: bytes, settings: KeySettings, repeat: int) -> float:
    runs = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(repeat):
            extract_key(body, settings=settings, path="/v1/chat/completions", tenant="t")
        runs.append((time.perf_counter() - started) / repeat * 1e6)
    return statistics.median(runs)


def main() -> None:
    print("| body | mode | PrefixLength | median us/call |")
    print("|---|---|---|---|")
    for size in (1024, 64 * 1024, 1024 * 1024):
        body = chat_body(size)
        repeat = max(20, 2_000_000 // size)
        for mode, length in (
            (PrefixMode.OPENAI, 1024),
            (PrefixMode.OPENAI, 65536),
            (PrefixMode.BYTES, 65536),
        ):
            us = per_call_us(body, KeySettings(prefix_length=length, mode=mode), repeat)
            print(f"| {len(body) // 1024} KB | {mode.value} | {length} | {us:.1f} |")
    print()
    print("| large body | size | median ms/call | keyed on |")
    print("|---|---|---|---|")
    settings = KeySettings(prefix_length=1024, mode=PrefixMode.OPENAI)
    for name, body in large_bodies():
        fallback = extract_key(body, settings=settings).fallback
        ms = per_call_us(body, settings, repeat=3) / 1000
        keyed_on = f"raw bytes ({fallback.value})" if fallback else "rendering"
        print(f"| {name} | {len(body) / 2**20:.1f} MiB | {ms:.2f} | {keyed_on} |")


def large_bodies() -> list[tuple[str, bytes]]:
    """Image and many-message chat bodies just under and well over 4 MiB."""
    rng = random.Random(7)
    bodies = []
    for image_mib in (3, 12):
        data = base64.b64encode(rng.randbytes(image_mib * 3 * 2**20 // 4)).decode()
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
        content = [{"type": "text", "text": "What is in this picture?"}, image]
        request = {"model": "m", "messages": [{"role": "user", "content": content}]}
        bodies.append((f"one {image_mib} MiB image", json.dumps(request).encode()))
    for count in (60_000, 160_000):
        messages = [
            {"role": ("user", "assistant")[i % 2], "content": f"turn {i}: how are you today?"}
            for i in range(count)
        ]
        request = {"model": "m", "messages": messages}
        bodies.append((f"{count:,} short messages", json.dumps(request).encode()))
    return bodies


if __name__ == "__main__":
    main()
