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
``bytes`` with a :class:`Fallback` reason that is counted, never raised. So does
a body larger than ``RouterConfig.openai_max_parse_bytes``: parsing JSON is the one cost that
grows with the whole body (a 10 MB body of many small messages takes ~70 ms to
parse), and ext_proc's event loop must not stall on one request.

Tenant scoping: the tenant header's value and the request's ``cache_salt`` are
mixed into the key, so two tenants never share a key (and so never an
instance's cache, which would leak timing across tenants).

Blocks: the first PrefixLength bytes of the rendering (or raw body) are cut into blocks
(:func:`block_ends`: ``block_bytes`` each at first, then growing geometrically) and named
by chained hashes, as vLLM names its KV blocks: block ``j``'s hash is ``xxh64(block j,
seed = hash of block j-1)``, the first seeded by the tenant and salt. A block's hash thus
stands for the whole prefix up to its end, which is what the prefix index (:mod:`.index`)
looks up to find the longest prefix an instance holds. The last block ends where the
prefix does (so a short prompt has one). A chat prompt also has a block ending at its
first message (a system prompt many conversations share) and at each of its last few
messages (where the conversation's previous turn ended, so the next turn finds the
instance that served it: :func:`message_leaves`); those blocks hang off the geometric
chain (:func:`hash_blocks`), so which ones a request has never changes another block's
hash. With ``block_bytes`` 0 the whole prefix is one block: the fixed-length key.

The key (the ``x-prefix-key`` value Envoy's ring hashes with xxh64) is the last block's
hash in hex. The request's prompt size, which the router weighs as prefill work, is
estimated from the body: ``len(body) / BYTES_PER_TOKEN`` tokens, where an image, audio or
file part of a message counts ``MEDIA_PART_TOKENS`` instead of its base64 data.

Cost: one orjson parse plus one pass over at most PrefixLength bytes of rendering (~20 us
for a 64 KB chat body) and one xxh64 per block. Rendering stops at PrefixLength: a 12 MB
base64 image in the first message costs what its first PrefixLength characters cost, not
a copy of the image.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any, NamedTuple

import orjson
import xxhash

from prefix_router.core.config import DEFAULT_OPENAI_MAX_PARSE_BYTES, PrefixMode
from prefix_router.core.pools import request_model

BYTES_PER_TOKEN = 4
"""Bytes of prompt text per token, to size a request's prefill work from its body (English
text in Llama-3's tokenizer averages about 4; the simulator's tokenizer is exactly 4)."""
DEFAULT_OUTPUT_TOKENS = 256
"""Output tokens expected of a request that names no limit (they fill the KV cache too)."""
MAX_OUTPUT_TOKENS = 8192
"""A request's stated limit is counted up to this much."""
MAX_PROMPT_TOKENS = 131_072
"""A prompt is counted as at most this long (Llama 3.1's context): a larger body cannot
be one prompt, and must not queue minutes of imagined prefill on an instance."""

OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
MEDIA_PART_TOKENS = 1_500
"""Prompt tokens counted for one image, audio or file part of a message, whatever its size
in the body: a vision model turns an image into ~1-3k tokens, where its base64 data would
count as hundreds of thousands (a 1 MB image: the 128k-token cap, seconds of imagined
prefill and a third of a KV cache written)."""
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})

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
    TOO_LARGE = "too_large"


@dataclass(frozen=True, slots=True)
class KeySettings:
    """The part of the config key extraction needs; hashable, built once per config."""

    prefix_length: int
    mode: PrefixMode
    max_parse_bytes: int = DEFAULT_OPENAI_MAX_PARSE_BYTES
    """``openai`` mode keys larger bodies on their raw bytes rather than parse them."""
    block_bytes: int = 0
    """Bytes per block of the prefix; 0: the whole prefix is one block (a fixed key)."""
    by_model: bool = False
    """The fleet routes by pool (:mod:`.pools`): find the request's ``model`` in every
    mode, and scope the key by it (the first block's seed), as vLLM scopes its cache by
    model and adapter."""


class PrefixKey(NamedTuple):
    value: str
    """The ``x-prefix-key`` header value: the last block's hash in hex."""
    blocks: tuple[int, ...] = ()
    """Chained 64-bit hashes of the prefix's blocks, first to last (never empty)."""
    ends: tuple[int, ...] = ()
    """Byte offset in the prefix where each block ends."""
    held: tuple[int, ...] = ()
    """Bytes of the prefix an instance holding block ``j`` is expected to have cached:
    past ``ends[j]`` (:func:`hash_blocks`), because a holder's earlier request went on past
    the block, and the instance that answered a conversation's turn caches the answer."""
    prompt_tokens: int = 1
    """The whole prompt's size in tokens, estimated from the body."""
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    """Tokens the request may generate (its limit, or the default)."""
    fallback: Fallback | None = None
    """Set when ``openai`` mode fell back to ``bytes``."""
    model: str | None = None
    """The request's ``model`` field (None: none found, or not looked for: ``bytes`` mode
    of a fleet without pools)."""


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
    prompt_tokens = _prompt_tokens(len(body))
    if settings.mode is PrefixMode.OPENAI:
        try:
            salt, prefix, messages, output, model, media = _render_openai(
                body, path=path, complete=complete, limit=limit, max_parse=settings.max_parse_bytes
            )
        except _Unrenderable as why:
            model = _raw_model(body, settings, complete) if why.reason in _PARSED_AGAIN else None
            return _key(tenant, "", body[:limit], settings, prompt_tokens, why.reason, model=model)
        if media.parts:
            prompt_tokens = _prompt_tokens(len(body) - media.chars, media.parts)
        return _key(tenant, salt, prefix, settings, prompt_tokens, None, output, model, messages)
    model = _raw_model(body, settings, complete)
    return _key(tenant, "", body[:limit], settings, prompt_tokens, None, model=model)


def _prompt_tokens(text_bytes: int, media_parts: int = 0) -> int:
    """The prompt's tokens, from the body's bytes that are not media and its media parts."""
    tokens = text_bytes // BYTES_PER_TOKEN + media_parts * MEDIA_PART_TOKENS
    return min(MAX_PROMPT_TOKENS, max(1, tokens))


_PARSED_AGAIN = frozenset(
    {Fallback.OTHER_PATH, Fallback.UNEXPECTED_SHAPE, Fallback.TOO_LARGE, Fallback.TRUNCATED}
)
"""Fallbacks whose body may still be a JSON object naming a model (embeddings, a large
image, ...)."""


def _raw_model(body: bytes, settings: KeySettings, complete: bool = True) -> str | None:
    """The ``model`` of a body ``openai`` mode did not render: looked for only when the
    fleet routes by pool (:func:`~prefix_router.core.pools.request_model`)."""
    if not settings.by_model:
        return None
    return request_model(body, settings.max_parse_bytes, complete=complete)


def _key(
    tenant: str,
    salt: str,
    prefix: bytes,
    settings: KeySettings,
    prompt_tokens: int,
    fallback: Fallback | None,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    model: str | None = None,
    messages: Sequence[MessageEnd] = (),
) -> PrefixKey:
    spine = block_ends(len(prefix), settings.block_bytes)
    block = settings.block_bytes
    leaves = message_leaves(messages, len(prefix), block) if block > 0 else ()
    scope = (model or "") if settings.by_model else ""
    ends, blocks, held = hash_blocks(_seed(tenant, salt, scope), prefix, spine, leaves)
    return PrefixKey(
        value=f"{blocks[-1]:016x}",
        blocks=blocks,
        ends=ends,
        held=held,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        fallback=fallback,
        model=model,
    )


@lru_cache(maxsize=4096)
def _seed(tenant: str, salt: str, model: str = "") -> int:
    """The first block's seed: 0 unscoped (no tenant, salt or pool model), so keys stay
    what they were before scopes existed."""
    if not tenant and not salt and not model:
        return 0
    scope = f"{tenant}{_FIELD}{salt}{_RECORD}"
    if model:
        scope += f"{model}{_RECORD}"
    return xxhash.xxh64_intdigest(scope.encode("utf-8", "surrogatepass"))


def _scales(count: int) -> tuple[int, ...]:
    out = [1, 2, 3]
    while len(out) < count:
        out.append(2 * out[-2])
    return tuple(out)


_SCALES = _scales(64)
"""Block ends in units of ``block_bytes``: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ..."""


@lru_cache(maxsize=4096)
def block_ends(length: int, block_bytes: int) -> tuple[int, ...]:
    """Where the blocks of a ``length``-byte prefix end (the last one at ``length``).

    The first four blocks are ``block_bytes`` long; after that each block ends 1.5 or
    1.33 times as far as the one before, so an ``n``-byte prefix has about
    ``2 log2(n / block_bytes)`` blocks and the index finds a long shared prefix to within
    a third of its length, at the cost of a few more blocks than a short one.
    ``block_bytes`` 0 is the fixed key: one block.
    """
    if block_bytes <= 0 or length <= block_bytes:
        return (length,)
    ends = [s * block_bytes for s in _SCALES if s * block_bytes < length]
    return (*ends, length)


def chain_hashes(seed: int, data: bytes, ends: Sequence[int]) -> tuple[int, ...]:
    """Chained xxh64 of ``data`` cut at ``ends``: block ``j`` is hashed with block
    ``j - 1``'s hash as its seed, so each hash names the whole prefix up to its end."""
    view = memoryview(data)
    out = []
    h = seed
    start = 0
    digest = xxhash.xxh64_intdigest
    for end in ends:
        h = digest(view[start:end], h)
        out.append(h)
        start = end
    return tuple(out)


class MessageEnd(NamedTuple):
    """Where one message of the rendering ends, and who spoke it."""

    end: int
    """Byte offset in the rendering just past the message."""
    role: str


TRAILING_MESSAGES = 4
"""Message ends of a conversation's tail that get a block (:func:`message_leaves`): the
previous turn's prompt ends two messages back (before the answer and the new question),
four with a tool call and its result in between."""


def message_leaves(
    messages: Sequence[MessageEnd], length: int, shortest: int = 1
) -> tuple[tuple[int, int], ...]:
    """``(end, held)`` of the blocks a chat prompt adds at message ends: the first message
    (a system prompt shared by many conversations) and the last :data:`TRAILING_MESSAGES`
    (where the conversation's previous turn ended). ``held`` reaches past the answer that
    follows a message, if one does. Ends at or past ``length`` are the prefix's own end;
    ends before ``shortest`` (a block's length) get none: a prefix that short saves less
    than a block's prefill, and as a block of its own a short instruction every request
    starts with would draw them all to its first holder."""
    inside = [i for i, m in enumerate(messages) if shortest <= m.end < length]
    out = []
    for i in sorted({*inside[:1], *inside[-TRAILING_MESSAGES:]}):
        end = messages[i].end
        answer = messages[i + 1] if i + 1 < len(messages) else None
        # an instance that computed this prefix for an earlier turn generated that answer
        held = min(answer.end, length) if answer and answer.role == "assistant" else end
        out.append((end, held))
    return tuple(out)


def hash_blocks(
    seed: int, data: bytes, spine: Sequence[int], leaves: Sequence[tuple[int, int]] = ()
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(ends, hashes, held)`` of the prefix's blocks, in order of their ends.

    ``spine`` (:func:`block_ends`) is chained: each of its blocks is hashed seeded by the one
    before, so a hash names its whole prefix and depends on nothing past it. Every other
    block ends at a ``leaves`` offset (a message end, with what its holder is expected to
    hold) or at the prefix's end, and is a leaf off the spine: hashed from the last spine
    end before it, seeded by that block. Which leaves a request has thus never changes
    another block's hash, so a conversation's next turn, which has other message ends,
    finds its previous turn's last block.

    ``held``: a leaf's holder holds what the leaf says; a spine block's holder is credited
    half the way to the next block's end, the expected length of a prefix it served that
    went on past the block (a shared document ends somewhere inside the next block)."""
    length = spine[-1]
    spine_hash = chain_hashes(seed, data, spine[:-1])
    marks = dict(leaves)
    marks[length] = length
    ends: list[int] = []
    hashes: list[int] = []
    held: list[int] = []
    digest = xxhash.xxh64_intdigest
    view = memoryview(data)
    s = 0  # spine blocks before the current end
    for end in sorted({*spine[:-1], *marks}):
        if s < len(spine) - 1 and spine[s] == end:
            hashes.append(spine_hash[s])
            s += 1
            held.append(-1)  # set below, once the next end is known
        else:
            start, parent = (spine[s - 1], spine_hash[s - 1]) if s else (0, seed)
            hashes.append(digest(view[start:end], parent))
            held.append(max(end, marks[end]))
        ends.append(end)
    reach = 0
    for j, h in enumerate(held):
        reach = max(reach, h if h >= 0 else ends[j] + (ends[j + 1] - ends[j]) // 2)
        held[j] = reach  # a deeper holder holds what a shallower one would
    return tuple(ends), tuple(hashes), tuple(held)


def _output_tokens(request: dict[str, Any]) -> int:
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, MAX_OUTPUT_TOKENS)
    return DEFAULT_OUTPUT_TOKENS


def _path_only(path: str) -> str:
    return path.split("?", 1)[0]


def _render_openai(
    body: bytes, *, path: str, complete: bool, limit: int, max_parse: int
) -> tuple[str, bytes, tuple[MessageEnd, ...], int, str | None, Media]:
    """``(cache_salt, first limit bytes of the canonical rendering, where its messages end,
    output tokens, model, its media parts)`` or :class:`_Unrenderable`.

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
    if len(body) > max_parse:
        raise _Unrenderable(Fallback.TOO_LARGE)
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
        prefix, messages = _first_bytes(_render_parts(request, route, limit), limit)
        model = request.get("model")
        output = _output_tokens(request)
        media = _media(request, route)
        return salt, prefix, messages, output, model if isinstance(model, str) else None, media
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


class Media(NamedTuple):
    """A request's media parts (image, audio, file): how many, and the characters of their
    strings in the body (base64 data, URLs), which are not prompt text."""

    parts: int = 0
    chars: int = 0


def _media(request: dict[str, Any], route: str) -> Media:
    if route == "/v1/chat/completions":
        items = request.get("messages")
    elif route == "/v1/responses":
        items = request.get("input")
    else:
        return Media()
    parts = chars = 0
    for item in items if isinstance(items, list) else ():
        content = item.get("content") if isinstance(item, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type", "text") not in _TEXT_PARTS:
                parts += 1
                chars += _string_chars(part)
    return Media(parts, chars)


def _string_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_string_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_string_chars(v) for v in value)
    return 0


Part = tuple[str, str | None]
"""One part of the rendering, and the role that speaks it if it is a message."""


def _render_parts(request: dict[str, Any], route: str, limit: int) -> Iterator[Part]:
    """The rendering's parts in prompt order. Each part is cut at ``limit`` characters
    at most (all the key can use of it), so no part costs more than the prefix does."""
    yield _text(request.get("model", "")), None
    yield _canonical_json(request.get("tools")), None
    if route == "/v1/chat/completions":
        yield from _render_messages(request.get("messages"), limit)
    elif route == "/v1/completions":
        yield _render_prompt(request.get("prompt")), None
    else:
        yield _text(request.get("instructions") or ""), None
        yield from _render_responses_input(request.get("input"), limit)


def _first_bytes(parts: Iterator[Part], limit: int) -> tuple[bytes, tuple[MessageEnd, ...]]:
    """The first ``limit`` bytes of the parts joined by a record separator, and where each
    message in them ends.

    A str of n characters encodes to at least n bytes, so each part is cut to the
    characters still needed before encoding: a 64 KB message costs what its
    prefix costs.
    """
    out = bytearray()
    ends: list[MessageEnd] = []
    for index, (part, role) in enumerate(parts):
        if index:
            out += b"\x1e"
        out += part[: limit - len(out)].encode("utf-8", "surrogatepass")
        if role is not None:
            ends.append(MessageEnd(min(len(out), limit), role))
        if len(out) >= limit:
            break
    return bytes(out[:limit]), tuple(ends)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)


def _canonical_json(value: Any) -> str:
    if value is None:
        return ""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _cut_strings(value: Any, limit: int) -> Any:
    """``value`` with every string cut to ``limit`` characters.

    Its canonical JSON then agrees with the uncut value's for at least the first
    ``limit`` bytes (a cut string still renders to >= ``limit`` bytes), which is all
    the key reads, while a 12 MB base64 image is never copied or escaped.
    """
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, dict):
        return {k: _cut_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_strings(v, limit) for v in value]
    return value


def _render_messages(messages: Any, limit: int) -> Iterator[Part]:
    if not isinstance(messages, list) or not messages:
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
    for message in messages:
        if not isinstance(message, dict):
            raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
        role = _text(message.get("role", ""))
        rendered = role + _FIELD + _render_content(message.get("content"), limit)
        for extra in ("name", "tool_call_id"):
            if message.get(extra) is not None:  # null is absent, as the server reads it
                rendered += _FIELD + _text(message[extra])
        if message.get("tool_calls"):
            rendered += _FIELD + _canonical_json(_cut_strings(message["tool_calls"], limit))
        yield rendered, role


def _render_content(content: Any, limit: int) -> str:
    """A message's content as a chat template renders it: text parts joined in order.

    Only the first ``limit`` characters are rendered, which is all the key reads of
    it (a character is at least a byte); a media part (image, audio, file) renders
    as its canonical JSON with strings cut at ``limit``.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content[:limit]
    if not isinstance(content, list):
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
    pieces = []
    length = 0
    for part in content:
        if length >= limit:
            break
        if isinstance(part, str):
            piece = part
        elif isinstance(part, dict):
            kind = part.get("type", "text")
            if kind in _TEXT_PARTS:
                piece = _text(part.get("text", ""))
            else:
                piece = _canonical_json(_cut_strings(part, limit))
        else:
            raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
        pieces.append(piece[:limit])
        length += len(piece) + 1
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


def _render_responses_input(items: Any, limit: int) -> Iterator[Part]:
    if isinstance(items, str):
        yield "user" + _FIELD + items[:limit], "user"
    elif isinstance(items, list) and items:
        rendered = False
        for item in items:
            if not isinstance(item, dict):
                continue
            rendered = True
            if "role" in item:
                yield from _render_messages([item], limit)
            else:  # a function call, its output, a reasoning item: the model sees them too
                kind = _text(item.get("type", ""))
                text = kind + _FIELD + _canonical_json(_cut_strings(item, limit))
                yield text, _ITEM_ROLES.get(kind)
        if not rendered:
            raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)
    else:
        raise _Unrenderable(Fallback.UNEXPECTED_SHAPE)


_ITEM_ROLES = {
    "function_call": "assistant",
    "reasoning": "assistant",
    "function_call_output": "tool",
}
"""Who speaks a Responses input item that has no role: the model its calls and reasoning
(an instance that computed the prompt before them generated them), the tool its output."""
