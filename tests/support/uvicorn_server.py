"""An ASGI app served by uvicorn in the test's own event loop, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn


@contextlib.asynccontextmanager
async def uvicorn_serving(config: uvicorn.Config) -> AsyncIterator[None]:
    """uvicorn serving ``config`` until the block ends (it then stops within 10 s)."""
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
