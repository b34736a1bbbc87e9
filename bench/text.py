"""Deterministic filler text, sized in tokens of the simulator's tokenizer (4 bytes each).

Text is drawn from a PRNG seeded by a string, so the same name always gives the same
bytes (across processes and Python versions: ``random.Random(str)`` hashes the string
with SHA-512) and different names give different text from the first bytes on. Letters
and spaces only, so JSON needs no escapes. Cost: one ``randbytes`` and one C-level
``translate`` per call, ~1 us per KB.
"""

from __future__ import annotations

import random
import string

BYTES_PER_TOKEN = 4
"""The simulator's tokenizer: every 4 bytes of UTF-8 are one token."""

_ALPHABET = (string.ascii_lowercase * 9 + " " * 22).encode()
_TABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


def filler_bytes(name: str, size: int) -> str:
    """``size`` bytes of pseudo-random lowercase text determined by ``name``."""
    if size <= 0:
        return ""
    return random.Random(name).randbytes(size).translate(_TABLE).decode("ascii")


def filler(name: str, tokens: int) -> str:
    """``tokens`` tokens (x 4 bytes) of filler text determined by ``name``."""
    return filler_bytes(name, tokens * BYTES_PER_TOKEN)
