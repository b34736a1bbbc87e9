"""Parsing and validation of OpenAI-compatible request bodies into engine parameters.

Pure: bytes in, a frozen :class:`ApiRequest` out, or a :class:`RequestError` whose message and
``param`` become an OpenAI-style error body. Every malformed input (bad JSON, wrong types,
out-of-range values, unknown model) ends here as a 400/404, never as a crash. Unknown fields
are ignored, as vLLM does; fields that do not change the simulation (temperature, stop, ...)
are accepted without checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from vllm_sim.config import EngineConfig
from vllm_sim.engine import GenerationParams
from vllm_sim.errors import BadRequestError, ModelNotFoundError
from vllm_sim.tokenizer import render_chat, tokenize, tokenize_segments

Kind = Literal["chat", "completion"]
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated generation request."""

    kind: Kind
    model: str
    params: GenerationParams
    stream: bool
    include_usage: bool


def load_object(body: bytes) -> dict[str, Any]:
    """The JSON object in ``body``; anything else is a 400."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequestError("The request body must be a JSON object.")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(data: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequestError(f"'{key}' must be an integer.", param=key)
    if value < minimum:
        raise BadRequestError(f"'{key}' must be at least {minimum}, got {value}.", param=key)
    return int(value)


def _opt_bool(data: Mapping[str, Any], key: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequestError(f"'{key}' must be a boolean.", param=key)
    return value


def resolve_model(data: Mapping[str, Any], config: EngineConfig) -> str:
    """The served name the request targets; a missing ``model`` means the base model."""
    model = data.get("model")
    if model is None:
        return config.model
    if not isinstance(model, str):
        raise BadRequestError("'model' must be a string.", param="model")
    if model not in config.served_models:
        raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
    return model


def _cache_salt(data: Mapping[str, Any]) -> str | None:
    salt = data.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise BadRequestError("'cache_salt' must be a non-empty string.", param="cache_salt")
    return salt


def _token_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value):
        return list(value)
    return None


def completion_prompt_tokens(data: Mapping[str, Any]) -> list[int]:
    """Tokens of a completion ``prompt``: a string, token ids, or a batch of exactly one."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt)
    tokens = _token_list(prompt)
    if tokens is None:
        raise BadRequestError(
            "'prompt' must be a string, a list of token ids, or a batch of one of those "
            "(the simulator serves one prompt per request).",
            param="prompt",
        )
    return tokens


def _check_messages(messages: Any) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty list.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(f"messages[{i}] must be an object.", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequestError(f"messages[{i}].role is missing or invalid.", param="messages")
        content = message.get("content")
        parts_ok = isinstance(content, list) and all(isinstance(p, dict) for p in content)
        if not (content is None or isinstance(content, str) or parts_ok):
            raise BadRequestError(
                f"messages[{i}].content must be a string, a list of parts or null.",
                param="messages",
            )
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise BadRequestError(f"messages[{i}].tool_calls must be a list.", param="messages")
    return messages


def chat_prompt_tokens(data: Mapping[str, Any]) -> list[int]:
    """Tokens of the chat template rendered over ``messages`` (and ``tools``)."""
    messages = _check_messages(data.get("messages"))
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequestError("'tools' must be a list.", param="tools")
    add_generation_prompt = _opt_bool(data, "add_generation_prompt", True)
    segments = render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return tokenize_segments(segments)


def parse_generation(body: bytes, kind: Kind, config: EngineConfig) -> ApiRequest:
    """Validate a ``/v1/completions`` or ``/v1/chat/completions`` body."""
    data = load_object(body)
    model = resolve_model(data, config)
    if kind == "chat":
        prompt = chat_prompt_tokens(data)
        max_tokens = _opt_int(data, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = _opt_int(data, "max_tokens", minimum=1)
        default_max = config.default_max_tokens
    else:
        prompt = completion_prompt_tokens(data)
        max_tokens = _opt_int(data, "max_tokens", minimum=1)
        default_max = COMPLETION_DEFAULT_MAX_TOKENS
    n = _opt_int(data, "n", minimum=1)
    if n not in (None, 1):
        raise BadRequestError("The simulator supports only n=1.", param="n")
    stream = _opt_bool(data, "stream", False)
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequestError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if not isinstance(options, dict):
            raise BadRequestError("'stream_options' must be an object.", param="stream_options")
        include_usage = _opt_bool(options, "include_usage", False)
    seed = data.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequestError("'seed' must be an integer.", param="seed")
    params = GenerationParams(
        prompt=prompt,
        max_tokens=max_tokens if max_tokens is not None else default_max,
        ignore_eos=_opt_bool(data, "ignore_eos", False),
        model=model,
        cache_salt=_cache_salt(data),
        seed=None if seed is None else int(seed) & 0xFFFFFFFF,
    )
    return ApiRequest(
        kind=kind, model=model, params=params, stream=stream, include_usage=include_usage
    )


def parse_tokenize(body: bytes, config: EngineConfig) -> list[int]:
    """Tokens of a ``/tokenize`` body: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
    data = load_object(body)
    resolve_model(data, config)
    if "messages" in data:
        return chat_prompt_tokens(data)
    if "prompt" in data:
        return completion_prompt_tokens(data)
    raise BadRequestError("Either 'prompt' or 'messages' is required.", param="prompt")
