"""Pools: the instances that may serve a request, chosen by the model it names.

Each instance serves some models: the base models and LoRA adapters it declares
(``Instance.models``), else those the control plane discovered on it
(``Instance.discovered``). The *pool* of a model is every instance that serves it; an
adapter's pool is the instances that have it loaded. A request's ``model`` field picks
its pool, and the ring, placement and spill then work within that pool only: a request
never reaches an instance that does not serve its model.

An instance that serves nothing known (nothing declared, nothing discovered) is assumed
to serve anything: it is in every pool and in the *catch-all* pool, which takes the
models no instance names. So a fleet that declares no model has one pool, the whole
fleet, and routes exactly as a fleet without pools; a model is unknown (answered 404 by
ext_proc) only when every instance declares what it serves and none serves it. A
request that names no model (not JSON, another path, no ``model`` field) goes over the
whole fleet, as before pools.

Envoy routes each pool through its own cluster (:func:`cluster_name`), whose ring is
built from the pool's instances exactly as ext_proc's mirror of that pool is:
:mod:`prefix_router.envoy.cluster` renders them from :func:`layout`, and
:class:`~prefix_router.core.table.RoutingTable` builds its pools from the same layout.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import orjson

from prefix_router.core.fleet import Instance

WHOLE_FLEET_CLUSTER = "models"
"""Envoy's cluster of every instance: the one cluster of a fleet without pools, and where
a request that names no model (or that ext_proc could not route) goes."""
POOL_CLUSTER_PREFIX = "models/"
CATCH_ALL = "*"
"""The catch-all pool's name (instances that declare nothing): not a valid model name of
a pool since a request naming ``*`` is just an unknown model."""
POOL_HEADER = "x-prefix-pool"
"""The header ext_proc sets to the pool's cluster name; Envoy's route sends the request
to the cluster it names (``cluster_header``)."""


def cluster_name(pool: str) -> str:
    """The Envoy cluster of pool ``pool`` (a model name, or :data:`CATCH_ALL`)."""
    return POOL_CLUSTER_PREFIX + pool


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Which instances serve which model, over one list of instances (in its order)."""

    by_model: Mapping[str, tuple[Instance, ...]]
    """Every model some instance serves -> the instances serving it (the catch-all
    instances included), sorted by model name."""
    catch_all: tuple[Instance, ...]
    """The instances that serve nothing known, so may serve anything."""

    @property
    def pooled(self) -> bool:
        """True when some instance says what it serves: requests are then routed by pool.
        False: one pool, the whole fleet (routing exactly as without pools)."""
        return bool(self.by_model)

    def clusters(self) -> dict[str, tuple[Instance, ...]]:
        """Envoy cluster name -> its instances, for every pool that needs one (none when
        not :attr:`pooled`: the whole-fleet cluster is always there)."""
        if not self.pooled:
            return {}
        out = {cluster_name(m): members for m, members in self.by_model.items()}
        if self.catch_all:
            out[cluster_name(CATCH_ALL)] = self.catch_all
        return out


def layout(instances: Sequence[Instance]) -> PoolLayout:
    """The pools of ``instances`` (see the module doc); each pool keeps their order."""
    catch_all = tuple(i for i in instances if not i.serves)
    names = sorted({m for i in instances for m in i.serves})
    by_model = {
        name: tuple(i for i in instances if not i.serves or name in i.serves) for name in names
    }
    return PoolLayout(by_model=MappingProxyType(by_model), catch_all=catch_all)


SCAN_BYTES = 64 * 1024
"""Of a body too large to parse, the model is looked for in this many bytes at its start
and at its end (clients write ``model`` before or after the messages)."""
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*("(?:[^"\\]|\\.)*")')


def request_model(body: bytes, max_parse_bytes: int, *, complete: bool = True) -> str | None:
    """The ``model`` field of a JSON request body, or None (not JSON, no string
    ``model``). Never raises.

    A body larger than ``max_parse_bytes``, or only the start of one (``complete``
    False), is not parsed: its first ``"model": "..."`` in the first or last
    :data:`SCAN_BYTES` is taken. In JSON a bare ``"`` only delimits strings, so that text
    can only be a ``model`` member (the request's, unless an object inside it has one
    before it)."""
    if not body or body.lstrip()[:1] != b"{":
        return None
    if len(body) > max_parse_bytes or not complete:
        return _scanned_model(body)
    try:
        request = orjson.loads(body)
    except (orjson.JSONDecodeError, RecursionError):
        return None
    model = request.get("model") if isinstance(request, dict) else None
    return model if isinstance(model, str) else None


def _scanned_model(body: bytes) -> str | None:
    for part in (body[:SCAN_BYTES], body[-SCAN_BYTES:]):
        found = _MODEL_FIELD.search(part)
        if found is not None:
            try:
                model = orjson.loads(found.group(1))
            except orjson.JSONDecodeError:
                return None
            return model if isinstance(model, str) else None
    return None


def unknown_model_body(model: str) -> bytes:
    """The 404 body vLLM's OpenAI server answers for a model it does not serve (its
    current shape, OpenAI's: the error nested under ``"error"``). The fleet's models are
    not listed: ``GET /v1/models`` lists them, as vLLM's does."""
    return orjson.dumps(
        {
            "error": {
                "message": f"The model `{model}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
    )


def models_list_body(instances: Iterable[Instance], created: int = 0) -> bytes:
    """``GET /v1/models`` for the whole fleet, as one vLLM server lists its own: each
    served model once, an adapter with its base model as ``parent`` when known."""
    parents: dict[str, str | None] = {}
    for instance in instances:
        known = {m.name: m.parent for m in instance.discovered}
        for name in instance.serves:
            if parents.get(name) is None:
                parents[name] = known.get(name)
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": parents[name] or name,
            "parent": parents[name],
        }
        for name in sorted(parents)
    ]
    return orjson.dumps({"object": "list", "data": data})
