"""The HTTP shell: an ASGI app (Starlette) exposing one :class:`SimInstance` like vLLM's server.

Routes parse, call the instance, and write; no simulation logic lives here. Errors raised
by the core map to OpenAI-style bodies here and only here::

    BadRequestError     400  {"error": {"type": "BadRequestError", "code": 400, ...}}
    ModelNotFoundError  404  {"error": {"type": "NotFoundError", "code": 404, ...}}
    fault "unhealthy"   503  {"error": {"type": "ServiceUnavailableError", "code": 503, ...}}

Every response carries ``x-sim-instance: <name>`` and echoes the request's ``x-request-id``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_sim.errors import EngineStoppedError, ModelNotFoundError, RequestError
from vllm_sim.faults import parse_fault
from vllm_sim.instance import SimInstance
from vllm_sim.metrics import CONTENT_TYPE_LATEST
from vllm_sim.protocol import Kind, parse_generation, parse_tokenize
from vllm_sim.responses import ChunkWriter, error_body, full_response, response_id
from vllm_sim.streaming import TokenStream, usage_of, watch_disconnect
from vllm_sim.tokenizer import detokenize_output

logger = logging.getLogger("vllm_sim")

Endpoint = Callable[[Request], Awaitable[Response]]


def _json(body: object, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(message: str, *, status: int, err_type: str, param: str | None = None) -> Response:
    body = error_body(message, err_type=err_type, param=param, code=status)
    return Response(body, status_code=status, media_type="application/json")


def _request_error(exc: RequestError) -> Response:
    if isinstance(exc, ModelNotFoundError):
        return _error(exc.message, status=404, err_type="NotFoundError", param=exc.param)
    return _error(exc.message, status=400, err_type="BadRequestError", param=exc.param)


async def _lora_name(request: Request) -> tuple[str, Response | None]:
    """The ``lora_name`` of a load/unload body, or the 400 answering a body without one."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        body = None
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        return "", _error(
            "lora_name is required", status=400, err_type="BadRequestError", param="lora_name"
        )
    return name, None


def _unavailable() -> Response:
    return _error(
        "The instance is unhealthy (fault injected) or stopping.",
        status=503,
        err_type="ServiceUnavailableError",
    )


def _guarded(handler: Endpoint) -> Endpoint:
    """Map core errors to HTTP; an unexpected bug is logged and answered 500, never a crash."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as exc:
            return _request_error(exc)
        except EngineStoppedError:
            return _unavailable()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.url.path)
            return _error("Internal simulator error.", status=500, err_type="InternalServerError")

    return endpoint


class _InstanceHeaders:
    """Pure ASGI middleware adding ``x-sim-instance`` and echoing ``x-request-id``."""

    def __init__(self, app: ASGIApp, *, name: str) -> None:
        self.app = app
        self.name = name.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = [(b"x-sim-instance", self.name)]
        extra += [(k, v) for k, v in scope["headers"] if k == b"x-request-id"]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _Routes:
    """Endpoints bound to one instance."""

    def __init__(self, instance: SimInstance) -> None:
        self.instance = instance

    async def generate(self, request: Request, kind: Kind) -> Response:
        instance = self.instance
        if not await instance.faults.admit():
            return _unavailable()
        api = parse_generation(await request.body(), kind, instance.config)
        handle = instance.submit(api, request_id=request.headers.get("x-request-id"))
        rid = response_id(kind, instance.next_id())
        created = int(time.time())
        if api.stream:
            writer = ChunkWriter(kind, rid=rid, created=created, model=api.model)
            return TokenStream(
                handle,
                writer,
                chat=kind == "chat",
                include_usage=api.include_usage,
                abort=lambda: instance.abort(handle),
            )
        watcher = watch_disconnect(request.receive, lambda: instance.abort(handle))
        try:
            await handle.wait_done()
        finally:  # also on cancellation: a request nobody waits for must not keep running
            watcher.cancel()
            if not handle.done:
                instance.abort(handle)
        if handle.aborted:
            return _error(
                "The request was aborted.", status=503, err_type="ServiceUnavailableError"
            )
        body = full_response(
            kind,
            rid=rid,
            created=created,
            model=api.model,
            text=detokenize_output(handle.output_ids),
            finish_reason=handle.seq.finish_reason,
            usage_body=usage_of(handle),
        )
        return Response(body, media_type="application/json")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def models(self, request: Request) -> Response:
        config = self.instance.config
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.instance.created,
                "owned_by": "vllm",
                "root": config.model,
                "parent": None if name == config.model else config.model,
                "max_model_len": config.effective_max_model_len,
            }
            for name in config.served_models
        ]
        return _json({"object": "list", "data": data})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime adapter loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the adapter
        is served under ``lora_name`` from now on."""
        name, error = await _lora_name(request)
        if error is not None:
            return error
        config = self.instance.config
        if name in config.served_models:
            return _error(
                f"The lora adapter '{name}' has already been loaded.",
                status=400,
                err_type="InvalidUserInput",
                param="lora_name",
            )
        self.instance.config = dataclasses.replace(
            config, lora_modules=(*config.lora_modules, name)
        )
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        name, error = await _lora_name(request)
        if error is not None:
            return error
        config = self.instance.config
        if name not in config.lora_modules:
            return _error(
                f"The lora adapter '{name}' cannot be found.",
                status=404,
                err_type="NotFoundError",
                param="lora_name",
            )
        self.instance.config = dataclasses.replace(
            config, lora_modules=tuple(m for m in config.lora_modules if m != name)
        )
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(self, request: Request) -> Response:
        if not await self.instance.faults.admit():
            return _unavailable()
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(self.instance.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        config = self.instance.config
        tokens = parse_tokenize(await request.body(), config)
        return _json(
            {
                "count": len(tokens),
                "max_model_len": config.effective_max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def version(self, request: Request) -> Response:
        return _json({"version": "vllm-sim"})

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.instance.engine.scheduler.cache.reset()
        return Response(status_code=200)

    async def get_fault(self, request: Request) -> Response:
        return _json(self.instance.faults.current.to_json())

    async def set_fault(self, request: Request) -> Response:
        self.instance.faults.set(parse_fault(await request.body()))
        return _json(self.instance.faults.current.to_json())

    async def state(self, request: Request) -> Response:
        return _json(self.instance.state())


class _RequireApiKey:
    """vLLM's ``--api-key``: every ``/v1`` route wants ``Authorization: Bearer <key>`` and
    answers 401 ``{"error": "Unauthorized"}`` without it; ``/health``, ``/metrics`` and the
    rest stay open."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await Response(
                    orjson.dumps({"error": "Unauthorized"}),
                    status_code=401,
                    media_type="application/json",
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(instance: SimInstance, *, api_key: str | None = None) -> ASGIApp:
    """ASGI app serving ``instance``; drive it with uvicorn or ``httpx.ASGITransport``.
    With ``api_key``, the ``/v1`` routes want it (:class:`_RequireApiKey`).

    The instance is stopped on ASGI lifespan shutdown; without a lifespan (in-process tests)
    the caller stops it with ``await instance.stop()``.
    """
    r = _Routes(instance)
    routes = [
        Route("/v1/completions", _guarded(r.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(r.chat), methods=["POST"]),
        Route("/v1/models", _guarded(r.models), methods=["GET"]),
        Route("/v1/load_lora_adapter", _guarded(r.load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", _guarded(r.unload_lora_adapter), methods=["POST"]),
        Route("/health", _guarded(r.health), methods=["GET"]),
        Route("/metrics", _guarded(r.metrics), methods=["GET"]),
        Route("/tokenize", _guarded(r.tokenize), methods=["POST"]),
        Route("/version", _guarded(r.version), methods=["GET"]),
        Route("/reset_prefix_cache", _guarded(r.reset_prefix_cache), methods=["POST"]),
        Route("/sim/fault", _guarded(r.get_fault), methods=["GET"]),
        Route("/sim/fault", _guarded(r.set_fault), methods=["POST"]),
        Route("/sim/state", _guarded(r.state), methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await instance.stop()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.instance = instance
    guarded: ASGIApp = _RequireApiKey(app, api_key=api_key) if api_key else app
    return _InstanceHeaders(guarded, name=instance.name)
