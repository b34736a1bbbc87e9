"""Prefix keys: stable across JSON spellings, different where the prompt differs."""

from __future__ import annotations

import json

import pytest

from prefix_router.core.config import PrefixMode
from prefix_router.core.key import (
    DEFAULT_OUTPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MEDIA_PART_TOKENS,
    Fallback,
    KeySettings,
    MessageEnd,
    PrefixKey,
    block_ends,
    extract_key,
    hash_blocks,
    message_leaves,
)

OPENAI = KeySettings(prefix_length=1024, mode=PrefixMode.OPENAI)
BYTES = KeySettings(prefix_length=16, mode=PrefixMode.BYTES)
CHAT = "/v1/chat/completions"

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. é ☃"},
    {"role": "user", "content": "Summarise the report."},
]


def key(body: bytes | str, *, path: str = CHAT, settings: KeySettings = OPENAI, **kw: str) -> str:
    raw = body.encode() if isinstance(body, str) else body
    return extract_key(raw, settings=settings, path=path, **kw).value


def test_json_spelling_does_not_change_the_key() -> None:
    compact = json.dumps({"model": "m", "messages": MESSAGES}, separators=(",", ":"))
    spaced = json.dumps({"messages": MESSAGES, "model": "m"}, indent=4)
    escaped = json.dumps({"model": "m", "messages": MESSAGES}, ensure_ascii=True)
    assert key(compact) == key(spaced) == key(escaped)


def test_fields_that_never_reach_the_prompt_do_not_change_the_key() -> None:
    base = {"model": "m", "messages": MESSAGES}
    varied = {**base, "temperature": 0.7, "max_tokens": 12, "stream": True, "user": "u1", "n": 2}
    assert key(json.dumps(base)) == key(json.dumps(varied))


def test_number_formatting_in_tools_does_not_change_the_key() -> None:
    a = (
        '{"model":"m","tools":[{"type":"function","function":{"name":"f","x":1.0}}],'
        '"messages":[{"role":"user","content":"hi"}]}'
    )
    b = (
        '{"messages":[{"content":"hi","role":"user"}],"model":"m",'
        '"tools":[{"function":{"x":1.00e0,"name":"f"},"type":"function"}]}'
    )
    assert key(a) == key(b)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other-lora"},
        {"messages": [{"role": "user", "content": "Summarise the report."}]},
        {"messages": [{"role": "system", "content": "You are a careless assistant."}]},
        {"tools": [{"type": "function", "function": {"name": "g"}}]},
    ],
)
def test_what_reaches_the_model_changes_the_key(change: dict[str, object]) -> None:
    base = {"model": "m", "messages": MESSAGES}
    assert key(json.dumps(base)) != key(json.dumps({**base, **change}))


def test_content_parts_render_like_a_plain_string() -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    plain = [{"role": "user", "content": "a\nb"}]
    assert key(json.dumps({"model": "m", "messages": parts})) == key(
        json.dumps({"model": "m", "messages": plain})
    )


def test_only_the_first_prefix_length_bytes_count() -> None:
    short = KeySettings(prefix_length=64, mode=PrefixMode.OPENAI)
    long_a = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100 + "a"}]})
    long_b = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100 + "b"}]})
    assert key(long_a, settings=short) == key(long_b, settings=short)
    assert key(long_a) != key(long_b)


def test_completions_prompt_is_keyed() -> None:
    path = "/v1/completions"
    assert key('{"model":"m","prompt":"abc"}', path=path) == key(
        '{"prompt": "abc", "model": "m", "max_tokens": 5}', path=path
    )
    assert key('{"model":"m","prompt":"abc"}', path=path) != key(
        '{"model":"m","prompt":"abd"}', path=path
    )


def test_tenants_and_cache_salts_never_share_a_key() -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES})

    def salted(salt: str) -> str:
        return json.dumps({"model": "m", "messages": MESSAGES, "cache_salt": salt})

    keys = [key(body), key(body, tenant="t1"), key(body, tenant="t2")]
    keys += [key(salted("s1")), key(salted("s2")), key(salted("s1"), tenant="t1")]
    assert len(set(keys)) == len(keys)
    # every way a body is keyed: bytes mode, and each of openai mode's fallbacks
    big = b'{"model": "m", "prompt": "' + b"x" * (64 * 1024) + b'"}'
    capped = KeySettings(prefix_length=1024, mode=PrefixMode.OPENAI, max_parse_bytes=64 * 1024)
    fallbacks = [
        (b"abc", BYTES, CHAT, {}),
        (b"not json", OPENAI, CHAT, {}),
        (b'{"input": "x"}', OPENAI, "/v1/embeddings", {}),
        (body.encode()[:40], OPENAI, CHAT, {"complete": False}),
        (big, capped, "/v1/completions", {}),
    ]
    for raw, settings, path, extra in fallbacks:
        tenants = {
            extract_key(raw, settings=settings, path=path, tenant=t, **extra).value
            for t in ("", "t1", "t2")
        }
        assert len(tenants) == 3, (raw[:20], path)


@pytest.mark.parametrize(
    ("body", "path", "reason"),
    [
        (b"not json at all", CHAT, Fallback.INVALID_JSON),
        (b'{"model": "m", "messages": [', CHAT, Fallback.INVALID_JSON),
        (b"\xff\xfe\x00binary", CHAT, Fallback.INVALID_JSON),
        (b"[1, 2, 3]", CHAT, Fallback.NOT_AN_OBJECT),
        (b"", CHAT, Fallback.NO_BODY),
        (b'{"model": 5, "messages": []}', CHAT, Fallback.UNEXPECTED_SHAPE),
        (b'{"model": "m", "messages": "hi"}', CHAT, Fallback.UNEXPECTED_SHAPE),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": 7}]}',
            CHAT,
            Fallback.UNEXPECTED_SHAPE,
        ),
        (b'{"model": "m"}', "/v1/embeddings", Fallback.OTHER_PATH),
    ],
)
def test_anything_else_falls_back_to_bytes_with_a_reason(
    body: bytes, path: str, reason: Fallback
) -> None:
    result = extract_key(body, settings=OPENAI, path=path)
    assert result.fallback is reason
    assert result.value == extract_key(body, settings=KeySettings(1024, PrefixMode.BYTES)).value


def test_a_truncated_body_falls_back_to_bytes() -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    result = extract_key(body, settings=OPENAI, path=CHAT, complete=False)
    assert result.fallback is Fallback.TRUNCATED


def test_bytes_mode_keys_on_the_first_prefix_length_bytes() -> None:
    assert key(b"0123456789abcdefXX", settings=BYTES) == key(b"0123456789abcdefYY", settings=BYTES)
    assert key(b"0123456789abcdeXXX", settings=BYTES) != key(b"0123456789abcdefYY", settings=BYTES)


def test_the_key_is_a_short_ascii_header_value() -> None:
    value = key(json.dumps({"model": "m", "messages": MESSAGES}))
    assert len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _image_request(data: str, *, question: str = "What is this?") -> str:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
    content = [{"type": "text", "text": question}, image]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def test_a_media_part_is_keyed_on_its_prefix_only() -> None:
    head = "iVBORw0KGgo" * 100  # past PrefixLength (1024)
    assert key(_image_request(head + "A" * 200_000)) == key(_image_request(head + "B" * 300_000))
    assert key(_image_request("A" + head)) != key(_image_request("B" + head))
    assert key(_image_request(head)) != key(_image_request(head, question="What is that?"))


def test_an_image_counts_as_the_tokens_a_vision_model_makes_of_it_not_its_base64() -> None:
    """A 1 MB base64 image counted by its bytes was the 128k-token cap: seconds of imagined
    prefill, and a third of an instance's KV cache written."""
    question = "What is in this picture? " * 40
    text_only = extract_key(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": question}]}).encode(), settings=OPENAI)  # fmt: skip
    for size in (1_000, 1_000_000):
        k = extract_key(_image_request("A" * size, question=question).encode(), settings=OPENAI)
        assert k.fallback is None
        assert text_only.prompt_tokens + MEDIA_PART_TOKENS <= k.prompt_tokens
        assert k.prompt_tokens < text_only.prompt_tokens + MEDIA_PART_TOKENS + 50
    responses = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"},
        {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 1_000_000},
    ]}]}  # fmt: skip
    k = extract_key(json.dumps(responses).encode(), settings=OPENAI, path="/v1/responses")
    assert MEDIA_PART_TOKENS <= k.prompt_tokens < MEDIA_PART_TOKENS + 100


def test_a_null_name_is_no_name() -> None:
    """Clients send ``"name": null``; vLLM takes it as absent, and so does the key (it fell
    back to the raw bytes)."""
    named = [{"role": "user", "content": "hi", "name": None}]
    k = extract_key(json.dumps({"model": "m", "messages": named}).encode(), settings=OPENAI)
    assert k.fallback is None
    assert k.value == key(json.dumps({"model": "m", "messages": [{"role": "user",
                                                                  "content": "hi"}]}))  # fmt: skip


def test_parts_past_the_prefix_are_not_rendered_but_the_prefix_is_unchanged() -> None:
    short = KeySettings(prefix_length=64, mode=PrefixMode.OPENAI)

    def parts(*texts: str) -> str:
        content = [{"type": "text", "text": t} for t in texts]
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})

    assert key(parts("a" * 64, "b"), settings=short) == key(parts("a" * 64, "c"), settings=short)
    assert key(parts("a" * 10, "b"), settings=short) != key(parts("a" * 10, "c"), settings=short)
    assert key(parts("a" * 10, "b"), settings=short) == key(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * 10 + "\nb"}]}),
        settings=short,
    )


def test_long_tool_call_arguments_are_keyed_on_their_prefix() -> None:
    def call(arguments: str) -> str:
        function = {"name": "f", "arguments": arguments}
        tool_call = {"id": "c1", "type": "function", "function": function}
        message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
        return json.dumps({"model": "m", "messages": [message]})

    assert key(call("x" * 5000 + "1")) == key(call("x" * 5000 + "2"))
    assert key(call("1" + "x" * 5000)) != key(call("2" + "x" * 5000))


def test_a_body_above_the_parse_limit_is_keyed_on_its_bytes_unparsed() -> None:
    capped = KeySettings(prefix_length=1024, mode=PrefixMode.OPENAI, max_parse_bytes=64 * 1024)
    small = _image_request("A" * 1000).encode()
    large = _image_request("A" * 70_000).encode()
    assert extract_key(small, settings=capped).fallback is None
    result = extract_key(large, settings=capped)
    assert result.fallback is Fallback.TOO_LARGE
    assert result.value == extract_key(large, settings=KeySettings(1024, PrefixMode.BYTES)).value


# -- blocks: what the prefix index looks up ---------------------------------------------------

BLOCKS = KeySettings(prefix_length=32 * 1024, mode=PrefixMode.BYTES, block_bytes=512)


@pytest.mark.parametrize(
    ("length", "block_bytes", "expected"),
    [
        (300, 512, (300,)),
        (512, 512, (512,)),
        (1000, 512, (512, 1000)),
        (2048, 512, (512, 1024, 1536, 2048)),
        (5000, 512, (512, 1024, 1536, 2048, 3072, 4096, 5000)),
        (32768, 512, (512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)),
        (5000, 0, (5000,)),
        (0, 512, (0,)),
    ],
)
def test_blocks_are_even_then_grow_geometrically(
    length: int, block_bytes: int, expected: tuple[int, ...]
) -> None:
    assert block_ends(length, block_bytes) == expected


def test_a_longer_prompt_shares_the_blocks_of_the_prefix_it_extends() -> None:
    first = extract_key(b"s" * 3000 + b"turn one", settings=BLOCKS, path="/x")
    second = extract_key(b"s" * 3000 + b"turn one" + b"t" * 4000, settings=BLOCKS, path="/x")
    shared = sum(1 for end in first.ends if end <= 3000)  # full blocks inside the shared part
    assert first.blocks[:shared] == second.blocks[:shared]
    assert first.blocks[shared] != second.blocks[shared]
    assert len(first.blocks) == len(first.ends) and first.ends[-1] == 3008


def test_each_block_hash_names_its_whole_prefix() -> None:
    a = extract_key(b"a" * 512 + b"x" * 512, settings=BLOCKS, path="/x")
    b = extract_key(b"b" * 512 + b"x" * 512, settings=BLOCKS, path="/x")
    assert a.blocks[1] != b.blocks[1]  # same second block, different prefix before it


def test_the_tenant_seeds_the_first_block() -> None:
    body = b"y" * 2048
    alice = extract_key(body, settings=BLOCKS, path="/x", tenant="alice")
    bob = extract_key(body, settings=BLOCKS, path="/x", tenant="bob")
    assert not set(alice.blocks) & set(bob.blocks)


def test_a_fixed_key_is_one_block_of_prefix_length() -> None:
    fixed = KeySettings(prefix_length=64, mode=PrefixMode.BYTES)
    k = extract_key(b"z" * 1000, settings=fixed, path="/x")
    assert k.ends == (64,) and len(k.blocks) == 1 and k.value == f"{k.blocks[0]:016x}"


def test_the_request_says_its_size_and_its_output_limit() -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 77}).encode()
    k = extract_key(body, settings=OPENAI)
    assert k.prompt_tokens == len(body) // 4 and k.output_tokens == 77
    unlimited = extract_key(
        json.dumps({"model": "m", "messages": MESSAGES}).encode(), settings=OPENAI
    )
    assert unlimited.output_tokens == DEFAULT_OUTPUT_TOKENS
    huge = extract_key(
        json.dumps({"model": "m", "messages": MESSAGES, "max_completion_tokens": 10**9}).encode(),
        settings=OPENAI,
    )
    assert huge.output_tokens == MAX_OUTPUT_TOKENS


# -- message ends: where a conversation's earlier turns end -----------------------------------

CHAT_BLOCKS = KeySettings(prefix_length=32 * 1024, mode=PrefixMode.OPENAI, block_bytes=256)


def chat(*messages: tuple[str, str]) -> PrefixKey:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    return extract_key(json.dumps(body).encode(), settings=CHAT_BLOCKS)


TURN_ONE = (("system", "s" * 7000), ("user", "u" * 400))
ANSWER = ("assistant", "a" * 1000)


def test_the_next_turn_holds_the_last_block_of_the_turn_before() -> None:
    one = chat(*TURN_ONE)
    two = chat(*TURN_ONE, ANSWER, ("user", "v" * 300))
    j = two.blocks.index(one.blocks[-1])
    assert two.ends[j] == one.ends[-1]
    # whoever computed turn one also generated (and cached) the answer that follows it
    answer_end = one.ends[-1] + len("\x1eassistant\x1f") + 1000
    assert two.held[j] == answer_end
    three = chat(*TURN_ONE, ANSWER, ("user", "v" * 300), ANSWER, ("user", "w" * 50))
    assert two.blocks[-1] in three.blocks


def test_a_system_message_ends_a_block_every_conversation_shares() -> None:
    a = chat(("system", "s" * 5000), ("user", "first question"))
    b = chat(("system", "s" * 5000), ("user", "another one, longer than the first"))
    system_end = len("m\x1e\x1esystem\x1f") + 5000
    assert system_end in a.ends and system_end in b.ends
    assert a.blocks[a.ends.index(system_end)] == b.blocks[b.ends.index(system_end)]


@pytest.mark.parametrize(
    ("messages", "length", "expected"),
    [
        ((), 100, ()),
        (((10, False),), 100, ((10, 10),)),
        (((10, True), (30, False)), 100, ((10, 30), (30, 30))),  # the answer's holder has it
        (((10, True), (130, False)), 100, ((10, 100),)),  # ... up to the prefix's end
        (((100, False),), 100, ()),  # the prefix's own end is always a block
        (((5, True), (30, False)), 100, ((30, 30),)),  # shorter than a block (10): none
        (
            tuple((10 * n, False) for n in range(1, 9)),
            1000,
            ((10, 10), (50, 50), (60, 60), (70, 70), (80, 80)),  # the first, the last four
        ),
    ],
)
def test_message_leaves(
    messages: tuple[tuple[int, bool], ...],
    length: int,
    expected: tuple[tuple[int, int], ...],
) -> None:
    # ``answer``: the next message is the assistant's
    ends = tuple(
        MessageEnd(end, "assistant" if n and messages[n - 1][1] else "user")
        for n, (end, _) in enumerate(messages)
    )
    assert message_leaves(ends, length, shortest=10) == expected


def test_leaves_never_change_the_spine_or_each_other() -> None:
    data = bytes(range(256)) * 40
    spine = block_ends(len(data), 512)
    plain, plain_hashes, _ = hash_blocks(7, data, spine)
    ends, hashes, held = hash_blocks(7, data, spine, ((700, 700), (5000, 6000)))
    assert (
        dict(zip(plain, plain_hashes, strict=True)).items()
        <= dict(zip(ends, hashes, strict=True)).items()
    )
    alone = dict(zip(*hash_blocks(7, data, spine, ((700, 700),))[:2], strict=True))
    assert alone[700] == dict(zip(ends, hashes, strict=True))[700]
    assert list(held) == sorted(held) and all(h >= e for h, e in zip(held, ends, strict=True))
    # a spine block's holder is credited half way to the next end; a leaf's what it says
    assert held[ends.index(512)] == 512 + (700 - 512) // 2
    assert held[ends.index(5000)] == 6000


def test_bytes_and_fixed_keys_have_no_message_ends() -> None:
    body = json.dumps({"model": "m", "messages": [*MESSAGES, *MESSAGES]}).encode()
    fixed = KeySettings(prefix_length=64, mode=PrefixMode.OPENAI)
    assert len(extract_key(body, settings=fixed).blocks) == 1
    raw = KeySettings(prefix_length=32 * 1024, mode=PrefixMode.BYTES, block_bytes=256)
    assert extract_key(body, settings=raw).ends == block_ends(len(body), 256)


def test_a_responses_agent_transcript_is_keyed_with_its_calls_and_their_outputs() -> None:
    """A Responses input's function calls, their outputs and reasoning items reach the
    model (vLLM renders them into the prompt) though they have no role: two transcripts
    that differ only in a tool's output are different prompts, and the next step of one
    shares its blocks, so it finds the instance that ran the step before."""

    def transcript(output: str, *more: dict[str, object]) -> PrefixKey:
        items: list[dict[str, object]] = [
            {"role": "user", "content": "What is the weather in Paris? " * 20},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": output},
            *more,
        ]
        body = json.dumps({"model": "m", "input": items}).encode()
        return extract_key(body, settings=OPENAI, path="/v1/responses")

    sunny, rainy = transcript("sunny, 21 C" * 10), transcript("rain, 12 C" * 10)
    assert sunny.fallback is None and sunny.value != rainy.value
    question = [{"role": "user", "content": "What is the weather in Paris? " * 20}]
    bare = extract_key(
        json.dumps({"model": "m", "input": question}).encode(),
        settings=OPENAI,
        path="/v1/responses",
    )
    assert sunny.value != bare.value
    step = transcript("sunny, 21 C" * 10, {"role": "assistant", "content": "It is sunny."})
    assert step.blocks[: len(sunny.blocks) - 1] == sunny.blocks[:-1]
