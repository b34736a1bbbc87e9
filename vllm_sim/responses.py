"""OpenAI-compatible response bodies and SSE chunks, shaped as vLLM's server shapes them.

Pure builders: ids, timestamps and texts in, bytes out (orjson). Streaming chunks are
``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_sim.protocol import Kind

DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_id(kind: Kind, serial: str) -> str:
    return f"chatcmpl-{serial}" if kind == "chat" else f"cmpl-{serial}"


def full_response(
    kind: Kind,
    *,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_body: dict[str, Any],
) -> bytes:
    """The non-streaming body of a finished request."""
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage_body,
            "system_fingerprint": None,
        }
    )


class ChunkWriter:
    """Builds the SSE events of one streamed request (ids and model fixed once)."""

    __slots__ = ("_kind", "_head")

    def __init__(self, kind: Kind, *, rid: str, created: int, model: str) -> None:
        self._kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = {"id": rid, "object": obj, "created": created, "model": model}

    def _event(self, body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def role(self) -> bytes:
        """Chat streams open with an empty assistant delta, as vLLM's do."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._event({**self._head, "choices": [choice]})

    def token(self, text: str, finish_reason: str | None) -> bytes:
        choice: dict[str, Any]
        if self._kind == "chat":
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        return self._event({**self._head, "choices": [choice]})

    def usage(self, usage_body: dict[str, Any]) -> bytes:
        """The ``stream_options.include_usage`` chunk: usage and no choices."""
        return self._event({**self._head, "choices": [], "usage": usage_body})


def error_body(message: str, *, err_type: str, param: str | None, code: int) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def error_event(message: str, *, err_type: str, code: int) -> bytes:
    """An error in the middle of a stream (the engine stopped), as vLLM reports it."""
    return b"data: " + error_body(message, err_type=err_type, param=None, code=code) + b"\n\n"
