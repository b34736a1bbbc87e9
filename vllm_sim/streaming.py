"""ASGI responses that wait on the engine: an SSE token stream and a disconnect watcher.

Both abort the request in the engine when the client goes away, so a gone client frees its
KV blocks and batch slot at once (vLLM does the same). Tokens that pile up while the client
is slow are sent as several SSE events in one write, which keeps a loaded simulator cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from vllm_sim.engine import RequestHandle
from vllm_sim.responses import DONE, ChunkWriter, error_event, usage
from vllm_sim.tokenizer import token_text


async def _abort_on_disconnect(receive: Receive, abort: Callable[[], None]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            abort()
            return


def watch_disconnect(receive: Receive, abort: Callable[[], None]) -> asyncio.Task[None]:
    """A task that calls ``abort`` if the client disconnects; cancel it when done."""
    return asyncio.get_running_loop().create_task(_abort_on_disconnect(receive, abort))


def usage_of(handle: RequestHandle) -> dict[str, int | dict[str, int]]:
    seq = handle.seq
    return usage(seq.prompt_len, seq.num_output, seq.cached_tokens or 0)


class TokenStream(Response):
    """``text/event-stream`` of one request's tokens, ending with ``data: [DONE]``."""

    def __init__(
        self,
        handle: RequestHandle,
        writer: ChunkWriter,
        *,
        chat: bool,
        include_usage: bool,
        abort: Callable[[], None],
    ) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        self._handle = handle
        self._writer = writer
        self._chat = chat
        self._include_usage = include_usage
        self._abort = abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle, writer = self._handle, self._writer
        watcher = watch_disconnect(receive, self._abort)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            events: list[bytes] = [writer.role()] if self._chat else []
            sent = 0
            while True:
                await handle.wait(sent)
                ready = handle.num_output
                if watcher.done():
                    return  # client gone; the request was aborted
                tokens = handle.seq.tokens
                base = handle.seq.prompt_len
                for i in range(sent, ready):
                    last = handle.done and i == ready - 1
                    reason = handle.seq.finish_reason if last and not handle.aborted else None
                    events.append(writer.token(token_text(tokens[base + i]), reason))
                sent = ready
                if handle.done:
                    break
                await send(
                    {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                )
                events.clear()
            if handle.aborted:
                events.append(
                    error_event(
                        "The request was aborted (the instance is stopping).",
                        err_type="ServiceUnavailableError",
                        code=503,
                    )
                )
            elif self._include_usage:
                events.append(writer.usage(usage_of(handle)))
            events.append(DONE)
            await send({"type": "http.response.body", "body": b"".join(events), "more_body": False})
        except OSError:
            self._abort()
        finally:
            watcher.cancel()
            if not handle.done:
                self._abort()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
