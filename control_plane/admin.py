"""The admin REST API: thin FastAPI routes over :class:`~control_plane.service.AdminService`.

Served on its own port, never on Envoy's data-plane listener. Every route
but ``GET /healthz``, ``GET /metrics`` (Prometheus text: counts and versions,
no secrets, so a scraper needs no token) and the status page's static files
(``GET /ui``, no data in them) needs ``Authorization: Bearer <token>`` (the
OpenAPI document and ``/docs`` too); with no token configured (allowed only on
a loopback address, see ``control_plane.server``) the API is open.

Errors map to status codes here and only here: invalid input -> 422 with a
``detail`` string naming each field and why (nothing changed), unknown
instance -> 404, duplicate -> 409, Redis unreachable -> 503.
"""

from __future__ import annotations

import hmac
from importlib import resources
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from control_plane.body_limit import BodyLimit
from control_plane.service import AdminService, InstanceExists, InstanceNotFound
from prefix_router.core.errors import ConfigError, FleetError
from prefix_router.core.fleet import Instance, InstanceState, canonical_address
from prefix_router.state.store import ConfigRecord, StateError


class InstanceIn(BaseModel):
    """A new instance; it starts active."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(min_length=1, examples=["10.0.0.7"])
    port: int = Field(ge=1, le=65535, examples=[8000])
    weight: int = Field(1, ge=1, le=128)
    models: list[str] = Field(default_factory=list, examples=[["llama-3-8b"]])
    hash_key: str | None = Field(None, description="Ring identity that survives address changes.")

    def to_instance(self) -> Instance:
        return Instance(
            address=canonical_address(self.address),
            port=self.port,
            weight=self.weight,
            models=tuple(self.models),
            hash_key=self.hash_key,
        )


def validation_text(exc: Exception) -> str:
    """Each invalid field and why, in one line (``models: Input should be a valid list``);
    any other error's own text."""
    if not isinstance(exc, ValidationError | RequestValidationError):
        return str(exc)
    reasons = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        reasons.append(f"{where}: {err['msg']}")
    return "; ".join(reasons)


class InstancePatch(BaseModel):
    """Fields to change; absent ones stay. ``state: draining`` drains without removing."""

    model_config = ConfigDict(extra="forbid")
    weight: int | None = Field(None, ge=1, le=128)
    models: list[str] | None = None
    hash_key: str | None = None
    """null clears it."""
    state: InstanceState | None = None

    @field_validator("weight", "models", "state", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        """Only ``hash_key`` can be cleared; null anywhere else is a mistake to name."""
        if value is None:
            raise ValueError("must not be null (leave the field out to keep its value)")
        return value


def _config_json(record: ConfigRecord) -> dict[str, Any]:
    return {"version": record.version, "config": record.config.to_json_dict()}


def _instance_json(instance: Instance, fleet_version: int) -> dict[str, Any]:
    return {"instance": instance.to_json_dict(), "fleet_version": fleet_version}


_bearer = HTTPBearer(auto_error=False)


def authorize(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The caller's name for the audit log, or 401 without the right bearer token."""
    token: str | None = request.app.state.token
    if token is None:
        return "anonymous"
    if credentials is None or not hmac.compare_digest(
        credentials.credentials.encode(), token.encode()
    ):
        raise HTTPException(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    return "admin"


Actor = Annotated[str, Depends(authorize)]


_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def _static(name: str) -> bytes:
    return resources.files("control_plane").joinpath("static", name).read_bytes()


def create_app(service: AdminService, *, token: str | None) -> FastAPI:
    app = FastAPI(
        title="prefix-router control plane",
        description="Fleet, routing config and xDS status of prefix-router.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.token = token
    app.add_middleware(BodyLimit)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_text(exc)}, status_code=422)

    @app.exception_handler(InstanceNotFound)
    async def _not_found(request: Request, exc: InstanceNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(InstanceExists)
    async def _exists(request: Request, exc: InstanceExists) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(ConfigError)
    @app.exception_handler(FleetError)
    async def _unprocessable(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    @app.exception_handler(StateError)
    async def _unavailable(request: Request, exc: StateError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.get("/healthz", tags=["probe"])
    async def healthz() -> dict[str, str]:
        """Liveness probe; the only route without auth."""
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(actor: Actor) -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    async def docs(actor: Actor) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/config", tags=["config"])
    async def get_config(actor: Actor) -> dict[str, Any]:
        return _config_json(await service.get_config())

    @app.put("/config", tags=["config"])
    async def put_config(
        actor: Actor, body: Annotated[dict[str, Any], Body(description="A whole RouterConfig.")]
    ) -> dict[str, Any]:
        return _config_json(await service.put_config(body, actor=actor))

    @app.patch("/config", tags=["config"])
    async def patch_config(
        actor: Actor,
        body: Annotated[dict[str, Any], Body(description="RouterConfig fields to change.")],
    ) -> dict[str, Any]:
        return _config_json(await service.patch_config(body, actor=actor))

    @app.get("/instances", tags=["instances"])
    async def list_instances(actor: Actor) -> dict[str, Any]:
        record = await service.list_instances()
        return {
            "fleet_version": record.fleet.version,
            "instances": [i.to_json_dict() for i in record.fleet.instances],
            "removing": sorted(record.removing),
        }

    @app.post("/instances", tags=["instances"], status_code=201)
    async def add_instance(actor: Actor, body: InstanceIn) -> dict[str, Any]:
        return _instance_json(*await service.add_instance(body.to_instance(), actor=actor))

    @app.get("/instances/{instance_id}", tags=["instances"])
    async def get_instance(actor: Actor, instance_id: str) -> dict[str, Any]:
        return {"instance": (await service.get_instance(instance_id)).to_json_dict()}

    @app.patch("/instances/{instance_id}", tags=["instances"])
    async def update_instance(
        actor: Actor, instance_id: str, body: InstancePatch
    ) -> dict[str, Any]:
        changes = body.model_dump(exclude_unset=True)
        return _instance_json(*await service.update_instance(instance_id, changes, actor=actor))

    @app.post("/instances/{instance_id}/drain", tags=["instances"], status_code=202)
    async def drain_instance(actor: Actor, instance_id: str) -> dict[str, Any]:
        """Stop new requests to it; it stays in the fleet (PATCH state=active undoes)."""
        return _instance_json(*await service.drain_instance(instance_id, actor=actor))

    @app.delete("/instances/{instance_id}", tags=["instances"], status_code=202)
    async def remove_instance(actor: Actor, instance_id: str) -> dict[str, Any]:
        """Drain, then remove once nothing is in flight on it (or the drain timeout passes)."""
        return _instance_json(*await service.drain_instance(instance_id, actor=actor, remove=True))

    @app.get("/status", tags=["status"])
    async def status(actor: Actor) -> dict[str, Any]:
        return await service.status()

    @app.get("/fleet", tags=["status"])
    async def fleet(actor: Actor) -> dict[str, Any]:
        """Per instance: ring share, in-flight, vLLM hit rate, TTFT, load; fleet totals; spills."""
        return await service.fleet()

    @app.get("/metrics", tags=["probe"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics of the control plane and the fleet view (no auth)."""
        return Response(await service.metrics(), media_type=CONTENT_TYPE_LATEST)

    page, script = _static("status.html"), _static("status.js")

    @app.get("/ui", include_in_schema=False)
    async def status_page() -> Response:
        """The status page (no data in it: it asks for the token and reads /fleet)."""
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @app.get("/ui/status.js", include_in_schema=False)
    async def status_script() -> Response:
        return Response(script, media_type="text/javascript; charset=utf-8")

    @app.get("/audit", tags=["status"])
    async def audit(
        actor: Actor, limit: Annotated[int, Query(ge=1, le=1000)] = 100
    ) -> list[dict[str, Any]]:
        return await service.audit(limit)

    return app


def create_metrics_app(service: AdminService) -> FastAPI:
    """``GET /metrics`` and ``GET /healthz`` alone, for a port of their own (``--metrics-port``).

    A NetworkPolicy can then let Prometheus reach the metrics without reaching the admin
    API. Both answer from the event loop that serves xDS and the admin API, so a hung loop
    fails ``/healthz`` here too.
    """
    app = FastAPI(
        title="prefix-router control plane metrics", openapi_url=None, docs_url=None, redoc_url=None
    )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(await service.metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
