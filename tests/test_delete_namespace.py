"""ops.launch.delete_namespace: every key under a namespace goes, and no other."""

from __future__ import annotations

import redis

from prefix_router.ops.launch import delete_namespace
from tests.conftest import REDIS_URL


def test_only_the_namespaces_keys_are_deleted_glob_characters_taken_literally(
    namespace: str,
) -> None:
    ours = f"{namespace}[a]*:"  # a namespace with pattern characters in it
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        client.set(f"{ours}fleet", "1")
        client.hset(f"{ours}load", "x", 1)
        client.set(f"{namespace}a-other:x", "kept")  # what "[a]*" as a pattern would match
        assert delete_namespace(REDIS_URL, ours) == 2
        assert client.exists(f"{ours}fleet", f"{ours}load") == 0
        assert client.get(f"{namespace}a-other:x") == b"kept"
        assert delete_namespace(REDIS_URL, ours) == 0
    finally:
        client.close()
