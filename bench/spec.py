"""What a benchmark sends: arrivals of one request or of a conversation, and their bodies.

An :class:`Arrival` starts at ``arrival_s`` (seconds of *model time*: simulated seconds
for the simulator, wall seconds for a real fleet) and carries one or more :class:`Turn`.
A single request is an arrival of one turn. A conversation's later turns are sent
``think_s`` after the previous turn's answer is complete and resend the conversation so
far, answers included (as a chat client does), so they depend on what was generated.

:func:`request_body` is the one place a turn becomes bytes: the live driver and the
discrete-event simulation both call it, so both send byte-identical prompts. Every
request asks for exactly ``max_tokens`` tokens (``ignore_eos``), streamed, with usage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import orjson

Message = tuple[str, str]
"""``(role, content)`` of one chat message."""

Endpoint = Literal["chat", "completion"]

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
}


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: chat messages appended to the conversation, or a completion prompt."""

    max_tokens: int
    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    think_s: float = 0.0
    """Model seconds after the previous turn's answer before this turn is sent."""

    @property
    def endpoint(self) -> Endpoint:
        return "completion" if self.prompt is not None else "chat"


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request, or a conversation's first turn, arriving at ``arrival_s``."""

    arrival_s: float
    group: str
    """The shared prefix it belongs to (a document, a system prompt, a file, ...)."""
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, seeded sequence of arrivals, in arrival order, built lazily.

    Iterating calls ``make`` afresh, so a workload can be replayed any number of times
    and yields the same arrivals each time; prompts exist only while they are in use.
    """

    name: str
    num_requests: int
    """Requests it sends (conversation turns count one each)."""
    make: Callable[[], Iterator[Arrival]] = field(repr=False)

    def __iter__(self) -> Iterator[Arrival]:
        return self.make()


def conversation(history: Sequence[Message], turn: Turn) -> tuple[Message, ...]:
    """The messages a turn sends: the conversation so far, then its own."""
    return (*history, *turn.messages)


def request_body(
    turn: Turn, *, model: str, history: Sequence[Message] = (), stream: bool = True
) -> bytes:
    """The JSON body of ``turn`` after ``history`` (previous messages and answers)."""
    body: dict[str, object] = {"model": model}
    if turn.prompt is not None:
        body["prompt"] = turn.prompt
    else:
        body["messages"] = [
            {"role": role, "content": content} for role, content in conversation(history, turn)
        ]
    body["max_tokens"] = turn.max_tokens
    body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)
