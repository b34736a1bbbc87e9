"""Deterministic stand-in tokenizer: every 4 bytes of UTF-8 text are one token.

A token id is an injective function of its 4-byte chunk (the chunk as a little-endian
integer), so identical byte prefixes give identical token prefixes and different chunks never
share an id (no false cache sharing). A short last chunk of k bytes (1-3) gets
``k << 32 | value``, which keeps it apart from every full chunk.

Chat prompts are rendered by a minimal template, tools first, then each message in order::

    <|tools|>\\n[tools as JSON]\\n<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n

The rendering is a list of *segments* (role header, content, line end) and each segment starts
a new token, as special tokens split a real tokenizer's text. That is what makes a multi-turn
follow-up hit the blocks cached while the previous answer was decoded: the answer's text
re-tokenizes to exactly the token ids that were generated.

Generated text is drawn from a 256-word vocabulary of 4-byte ASCII words (one token each),
by a PRNG seeded from the request, so a response is reproducible. Cost: O(bytes), ~0.1 ms
for a 4 KB prompt.
"""

from __future__ import annotations

import random
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

TOKEN_BYTES = 4
_LITTLE = sys.byteorder == "little"


def tokenize_bytes(data: bytes) -> list[int]:
    """Token ids of ``data``: one per 4 bytes, the last one possibly short.

    A full chunk's id is the chunk read as a little-endian 32-bit integer: an injective (so
    collision-free) hash that costs one C-level conversion per prompt, not a Python
    operation per token. A short tail of ``k`` bytes gets ``k << 32 | value``.
    """
    full = len(data) // TOKEN_BYTES
    chunks = array("I", data[: full * TOKEN_BYTES])
    if not _LITTLE:
        chunks.byteswap()
    tokens = chunks.tolist()
    tail = data[full * TOKEN_BYTES :]
    if tail:
        tokens.append((len(tail) << 32) | int.from_bytes(tail, "little"))
    return tokens


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` as UTF-8."""
    return tokenize_bytes(text.encode("utf-8", "surrogatepass"))


def tokenize_segments(segments: Iterable[str]) -> list[int]:
    """Token ids of a rendered prompt; each segment starts a new token."""
    tokens: list[int] = []
    for segment in segments:
        tokens.extend(tokenize(segment))
    return tokens


def _content_text(content: Any) -> str:
    """Message content as the template renders it: text parts joined, others as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
    return "\n".join(parts)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[str]:
    """Segments of the chat template for ``messages`` (already validated by the caller).

    An assistant message's ``tool_calls`` are rendered after its content as compact JSON,
    so a follow-up that resends them changes the prompt exactly where a real template would.
    """
    segments: list[str] = []
    if tools:
        segments += ["<|tools|>\n", orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode(), "\n"]
    for message in messages:
        segments.append(f"<|{message['role']}|>\n")
        segments.append(_content_text(message.get("content")))
        tool_calls = message.get("tool_calls")
        if tool_calls:
            segments.append(orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS).decode())
        segments.append("\n")
    if add_generation_prompt:
        segments.append("<|assistant|>\n")
    return segments


def _vocabulary() -> tuple[tuple[str, ...], tuple[int, ...]]:
    words = tuple(f" {c}{v}{e}" for c in "bdfghklmnprstvwz" for v in "aeio" for e in "nrst")
    return words, tuple(tokenize(word)[0] for word in words)


OUTPUT_WORDS, OUTPUT_TOKEN_IDS = _vocabulary()


def generate_output(seed: int, count: int) -> list[int]:
    """``count`` output token ids, reproducible from ``seed``; each is one vocabulary word."""
    draws = random.Random(seed).randbytes(count)
    ids = OUTPUT_TOKEN_IDS
    return [ids[b] for b in draws]


_WORD_OF_ID: dict[int, str] = dict(zip(OUTPUT_TOKEN_IDS, OUTPUT_WORDS, strict=True))


def detokenize_output(token_ids: Iterable[int]) -> str:
    """Text of generated token ids (only ids from :func:`generate_output` are known)."""
    return "".join(_WORD_OF_ID[t] for t in token_ids)


def token_text(token_id: int) -> str:
    """Text of one generated token id."""
    return _WORD_OF_ID[token_id]
