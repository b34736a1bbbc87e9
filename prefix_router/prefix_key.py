"""The prefix key: which cached prefix a request would reuse, as one short string.

Two modes (``RouterConfig.prefix_mode``):

``bytes``
    The first PrefixLength bytes of the raw body (the reference product's rule).

``openai``
    For JSON bodies on the OpenAI endpoints, a canonical rendering of what
    reaches the model, in prompt order: the model name (LoRA adapters are model
    names), the tools, then each message's role and content (content parts
    joined as a chat template joins them), or the completion prompt; the first
    PrefixLength bytes of that rendering are keyed on. JSON whitespace, key
    order, number formatting, unicode escapes and fields that never reach the
    prompt (temperature, stream, user, ...) do not change the key.

Anything ``openai`` cannot render (another path, no body, invalid JSON or
UTF-8, a body cut at Envoy's buffer limit, unexpected types) falls back to
``bytes`` with a :class:`Fallback` reason that is counted, never raised.

Tenant scoping: the tenant header's value and the request's ``cache_salt`` are
mixed into the key, so two tenants never share a key (and so never an
instance's cache, which would leak timing across tenants).

The key is ``xxh3_128(tenant, salt, prefix)`` in hex: 32 ASCII characters that
Envoy's ring hashes with xxh64. Cost: one orjson parse plus one pass over at
most PrefixLength bytes of rendering (~20 us for a 64 KB chat body).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
import xxhash

from prefix_router.config import PrefixMode

OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})

_FIELD = "\x1f"
_RECORD = "\x1e"


class Fallback(StrEnum):
    """Why ``openai`` mode fell back to ``bytes`` for one request."""

    OTHER_PATH = "other_path"
    NO_BODY = "no_body"
    TRUNCATED = "truncated"
    INVALID_JSON = "invalid_json"
    NOT_AN_OBJECT = "not_an_object"
    UNEXPECTED_SHAPE = "unexpected_shape"


@dataclass(frozen=True, slots=True)
class KeySettings:
    """The part of the config key extraction needs; hashable, built once per config."""

    prefix_length: int
    mode: PrefixMode


@dataclass(frozen=True, slots=True)
class PrefixKey:
    value: str
    """The ``x-prefix-key`` header value."""
    fallback: Fallback | None = None
    """Set when ``openai`` mode fell back to ``bytes``."""


class _Unrenderable(Exception):
    def __init__(self, reason: Fallback) -> None:
        self.reason = reason


def extract_key(
    body: bytes,
    *,
    settings: KeySettings,
    path: str = "/v1/chat/completions",
    tenant: str = "",
    complete: bool = True,
) -> PrefixKey:
    """The prefix key of one request. Pure; never raises for any input.

    ``complete`` is False when Envoy sent only the first part of a body larger
    than its buffer: ``openai`` mode then keys on the raw bytes.
    """
    limit = settings.prefix_length
    if settings.mode is PrefixMode.OPENAI:
        try:
            salt, prefix = _render_openai(body, path=path, complete=complete, limit=limit)
        except _Unrenderable as why:
            return PrefixKey(_digest(tenant, "", body[:limit]), why.reason)
        return PrefixKey(_digest(tenant, salt, prefix))
    return PrefixKey(_digest(tenant, "", body[:limit]))


def _digest(tenant: str, salt: str, prefix: bytes) -> str:
    h = xxhash.xxh3_128()
    if tenant or salt:
        h.update(f"{tenant}{_FIELD}{salt}{_RECORD}".encode("utf-8", "surrogatepass"))
    h.update(prefix)
    return h.hexdigest()


def _path_only(path: str) -> str:
    return path.split("?", 1)[0]


def _render_openai(body: bytes, *, path: str, complete: bool, limit: int) -> tuple[str, bytes]:
    """``(cache_salt, first limit bytes of the canonical rendering)`` or :class:`_Unrenderable`.

    Parts are rendered lazily and only until ``limit`` bytes exist: what lies past
    the prefix is never examined.
    """
    route = _path_only(path)
    if route not in OPENAI_PATHS:
        raise _Unrenderable(Fallback.OTHER_PATH)
    if not body:
        raise _Unrenderable(Fallback.NO_BODY)
    if not complete:
        raise _Unrenderable(Fallback.TRUNCATED)
    try:
        request = orjson.loads(body)
    except (orjson.JSONDecodeError, RecursionError):
        raise _Unrenderable(Fallback.INVALID_JSON) from None
    if not isinstance(request, dict):
        raise _Unrenderable(Fallback.NOT_AN_OBJECT)
    try:
        salt = request.get("cache_salt") or ""
        if not isinstance(salt, str):
            raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
        return salt, _first_bytes(_render_parts(request, route), limit)
    except _Unrenderable:
        raise
    except (
        TypeError,
        ValueError,
        AttributeError,
        KeyError,
        RecursionError,
        orjson.JSONEncodeError,
    ):
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE) from None


def _render_parts(request: dict[str, Any], route: str) -> Iterator[str]:
    yield _text(request.get("model", ""))
    yield _canonical_json(request.get("tools"))
    if route == "/v1/chat/completions":
        yield from _render_messages(request.get("messages"))
    elif route == "/v1/completions":
        yield _render_prompt(request.get("prompt"))
    else:
        yield _text(request.get("instructions") or "")
        yield from _render_responses_input(request.get("input"))


def _first_bytes(parts: Iterator[str], limit: int) -> bytes:
    """The first ``limit`` bytes of the parts joined by a record separator.

    A str of n characters encodes to at least n bytes, so each part is cut to the
    characters still needed before encoding: a 64 KB message costs what its
    prefix costs.
    """
    out = bytearray()
    for index, part in enumerate(parts):
        if index:
            out += b"\x1e"
        out += part[: limit - len(out)].encode("utf-8", "surrogatepass")
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)


def _canonical_json(value: Any) -> str:
    if value is None:
        return ""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _render_messages(messages: Any) -> Iterator[str]:
    if not isinstance(messages, list) or not messages:
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
    for message in messages:
        if not isinstance(message, dict):
            raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
        rendered = _text(message.get("role", "")) + _FIELD + _render_content(message.get("content"))
        for extra in ("name", "tool_call_id"):
            if extra in message:
                rendered += _FIELD + _text(message[extra])
        if message.get("tool_calls"):
            rendered += _FIELD + _canonical_json(message["tool_calls"])
        yield rendered


def _render_content(content: Any) -> str:
    """A message's content as a chat template renders it: text parts joined in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
    pieces = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
        elif isinstance(part, dict):
            kind = part.get("type", "text")
            if kind in ("text", "input_text", "output_text"):
                pieces.append(_text(part.get("text", "")))
            else:
                pieces.append(_canonical_json(part))
        else:
            raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
    return "\n".join(pieces)


def _render_prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return str(prompt[0])  # a batch: the first prompt's prefix decides the instance
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt))
        if isinstance(prompt[0], list):
            return _render_prompt(prompt[0])
    raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)


def _render_responses_input(items: Any) -> Iterator[str]:
    if isinstance(items, str):
        yield "user" + _FIELD + items
    elif isinstance(items, list) and items:
        yield from _render_messages([i for i in items if isinstance(i, dict) and "role" in i])
    else:
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
