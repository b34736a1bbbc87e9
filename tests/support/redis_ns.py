"""A unique Redis namespace per test, deleted at teardown (the Redis at REDIS_URL is shared)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from prefix_router.state.store import StateStore
from tests.conftest import REDIS_URL


def unique_namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


@contextlib.asynccontextmanager
async def fresh_store(namespace: str | None = None) -> AsyncIterator[StateStore]:
    """A :class:`StateStore` on a fresh namespace; every key of it is deleted afterwards."""
    st = StateStore.from_url(REDIS_URL, namespace or unique_namespace())
    try:
        yield st
    finally:
        await st.delete_namespace()
        await st.close()


def delete_namespace(namespace: str) -> None:
    """Delete every key of ``namespace`` (from synchronous fixture teardown)."""

    async def delete() -> None:
        async with fresh_store(namespace):
            pass

    asyncio.run(delete())
