"""A stand-in HTTP backend for data-plane tests: answers with its own name.

Several run in one process, one port each (``python -m tests.support.echo_backend
PORT [PORT...]``). Each answers any request with JSON ``{"backend": port,
"bytes": body length, "prefix_key": header seen}`` and ``/health`` with 200.
A request with an ``x-hold-ms`` header is answered that much later (requests that
stay in flight, as generations do).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import uvicorn


def make_app(name: str) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        size = 0
        more = True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if "x-hold-ms" in headers:
            await asyncio.sleep(int(headers["x-hold-ms"]) / 1000)
        body = json.dumps(
            {"backend": name, "bytes": size, "prefix_key": headers.get("x-prefix-key")}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"x-backend", name.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


async def serve(ports: list[int]) -> None:
    servers = [
        uvicorn.Server(
            uvicorn.Config(make_app(str(p)), host="127.0.0.1", port=p, log_level="warning")
        )
        for p in ports
    ]
    await asyncio.gather(*(s.serve() for s in servers))


if __name__ == "__main__":
    asyncio.run(serve([int(p) for p in sys.argv[1:]]))
