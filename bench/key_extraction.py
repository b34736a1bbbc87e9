"""Micro-benchmark of prefix key extraction (the pure function on ext_proc's hot path).

    python bench/key_extraction.py

Prints the median time per call for 1 KB, 64 KB and 1 MB OpenAI chat bodies in
both modes. Target: <= 50 us for a 64 KB chat body in openai mode.
"""

from __future__ import annotations

import statistics
import time

from _harness import chat_body

from prefix_router.config import PrefixMode
from prefix_router.prefix_key import KeySettings, extract_key


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


if __name__ == "__main__":
    main()
