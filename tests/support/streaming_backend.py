"""A backend whose every answer streams for a while: a long generation, as Envoy sees it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

LAST_CHUNK = b"data: [DONE]\n\n"


def streaming_backend(port: int, *, seconds: float) -> uvicorn.Config:
    """``POST /v1/chat/completions`` on 127.0.0.1:``port`` streams a chunk every 0.1 s for
    ``seconds``, then :data:`LAST_CHUNK` (serve it with ``uvicorn_serving``)."""

    async def generate(_: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(int(seconds * 10)):
                await asyncio.sleep(0.1)
                yield f"data: {i}\n\n".encode()
            yield LAST_CHUNK

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"])])
    return uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
