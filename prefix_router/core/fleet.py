"""The fleet: model-serving instances and the immutable, versioned view of them.

An :class:`Instance` is a value (address, port, weight, models, state). A
:class:`Fleet` is an immutable, versioned tuple of instances sorted by id: the
control plane publishes it to Envoy (EDS, in this order) and ext_proc builds its
ring mirror from it, so both sides see the same membership in the same order.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from prefix_router.core.errors import FleetError


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model an instance was found serving (its ``GET /v1/models``): a base model, or a
    LoRA adapter with the base model it was loaded on as ``parent``."""

    name: str
    parent: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return {"id": self.name, "parent": self.parent}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> ServedModel:
        parent = data.get("parent")
        return cls(name=str(data["id"]), parent=None if parent is None else str(parent))


INSTANCE_API_KEY_ENV = "VLLM_API_KEY"
"""The environment variable holding the instances' API key (the one vLLM's ``--api-key``
reads too): what the router's own requests to an instance, or through the router, carry."""

MAX_MODEL_NAME = 256


def check_model_name(name: str) -> None:
    """A served model name becomes an Envoy cluster name and a header value: printable
    ASCII (no spaces), 1..256 characters."""
    if not 0 < len(name) <= MAX_MODEL_NAME or not all(" " < c <= "~" for c in name):
        raise FleetError(
            f"model name {name!r} must be 1..{MAX_MODEL_NAME} printable ASCII characters, no spaces"
        )


_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
"""One DNS label as hosts are named (RFC 1123; ``_`` too, as Docker names containers)."""


def _is_ip_literal(address: str) -> bool:
    return ":" in address or all(part.isdigit() for part in address.split("."))


def canonical_address(address: str) -> str:
    """The address as Envoy writes it, where a fleet is written (the admin API, a fleet
    file, ``--backend``): Envoy hashes an IP instance's ring entries as ``ip:port`` in its
    own form, and ext_proc's mirror must hash the same text, so an IPv6 address is
    compressed and lower-cased (``FD00:0::7`` -> ``fd00::7``). One with an IPv4 address
    inside (``::ffff:10.0.0.7``) is left as given: Python and Envoy print those differently
    (Python 3.11 ``::ffff:a00:7``). A name is left as given. Instances read back from
    Redis are not rewritten: their ids are what Redis, Envoy and the counts know."""
    check_address(address)
    if ":" not in address:
        return address
    ip = ipaddress.IPv6Address(address)
    if ip.ipv4_mapped is not None or (int(ip) >> 32 == 0 and int(ip) > 1):
        return address
    return ip.compressed


def check_address(address: str) -> None:
    """An instance's address is an IP literal or a host name Envoy and the prober can
    use: ``10.0.0.7``, ``fd00::7``, ``vllm-0.vllm.ns.svc``. Anything else would be taken
    by the admin API and then fail every health probe, scrape and DNS lookup of it."""
    if _is_ip_literal(address):
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise FleetError(f"instance address {address!r} is not a valid IP address") from None
        return
    name = address[:-1] if address.endswith(".") else address
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise FleetError(
            f"instance address {address!r} is neither an IP address nor a host name "
            "(dot-separated labels of 1..63 letters, digits, '-' or '_', 253 characters at most)"
        )


class InstanceState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    """Receives no new requests; removed once its in-flight count is 0 or a timeout passes."""


@dataclass(frozen=True, slots=True)
class Instance:
    """One model-serving instance (a vLLM server or a simulated one)."""

    address: str
    port: int
    weight: int = 1
    models: tuple[str, ...] = ()
    state: InstanceState = InstanceState.ACTIVE
    hash_key: str | None = None
    """Envoy ``envoy.lb`` metadata ``hash_key``: a ring identity that survives address changes."""
    healthy: bool = True
    draining_since: float | None = None
    discovered: tuple[ServedModel, ...] = ()
    """What the control plane found the instance serving (``GET /v1/models``); used only
    while nothing is declared in ``models``, which always takes precedence."""

    def __post_init__(self) -> None:
        if not self.address:
            raise FleetError("instance address must not be empty")
        if not isinstance(self.address, str):
            raise FleetError(f"instance address {self.address!r} must be a string")
        check_address(self.address)
        if not 0 < self.port < 65536:
            raise FleetError(f"instance port {self.port} out of range 1..65535")
        if not 1 <= self.weight <= 128:
            raise FleetError(f"instance weight {self.weight} out of range 1..128")
        for name in self.models:
            if not isinstance(name, str):
                raise FleetError(f"model name {name!r} must be a string")
            check_model_name(name)
        if self.hash_key is not None and not isinstance(self.hash_key, str):
            raise FleetError(f"hash_key {self.hash_key!r} must be a string")

    @property
    def id(self) -> str:
        """``address:port``, the name used everywhere (admin API, metrics, Redis)."""
        return (
            f"[{self.address}]:{self.port}"
            if ":" in self.address
            else f"{self.address}:{self.port}"
        )

    @property
    def ring_key(self) -> str:
        """The string Envoy hashes for this instance's ring entries."""
        return self.hash_key or self.id

    @property
    def serves(self) -> tuple[str, ...]:
        """The model names requests may reach this instance with: the declared ``models``,
        else the discovered ones; empty: unknown, so it may serve any (see :mod:`.pools`)."""
        return self.models or tuple(m.name for m in self.discovered)

    @property
    def base_models(self) -> frozenset[str]:
        """The base models behind what it serves (a discovered LoRA adapter counts as the
        model it was loaded on); empty: unknown. Instances with the same ones run the same
        weights, so the control plane takes them to prefill alike
        (:func:`prefix_router.core.work.rates_by_group`)."""
        if self.models:
            return frozenset(self.models)
        return frozenset(m.parent or m.name for m in self.discovered)

    @property
    def routable(self) -> bool:
        """True when Envoy's load balancer may pick it for a new request."""
        return self.state is InstanceState.ACTIVE and self.healthy

    def with_changes(self, **changes: Any) -> Instance:
        return replace(self, **changes)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "address": self.address,
            "port": self.port,
            "weight": self.weight,
            "models": list(self.models),
            "state": self.state.value,
            "hash_key": self.hash_key,
            "healthy": self.healthy,
            "draining_since": self.draining_since,
            "discovered": [m.to_json_dict() for m in self.discovered],
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Instance:
        """An instance as Redis holds it. Read leniently: what an older version wrote
        (a numeric ``hash_key``, ``models`` a single name, from a fleet file read loosely)
        must not make the whole fleet unreadable, and with it the admin API that would
        repair it; the strict checks are where a fleet is written."""
        models = data.get("models") or ()
        hash_key = data.get("hash_key")
        return cls(
            address=str(data["address"]),
            port=int(data["port"]),
            weight=int(data.get("weight", 1)),
            models=(models,) if isinstance(models, str) else tuple(str(m) for m in models),
            state=InstanceState(data.get("state", "active")),
            hash_key=None if hash_key is None else str(hash_key),
            healthy=bool(data.get("healthy", True)),
            draining_since=data.get("draining_since"),
            discovered=tuple(ServedModel.from_json_dict(m) for m in data.get("discovered") or ()),
        )

    @classmethod
    def from_url(cls, url: str) -> Instance:
        """``[http://]host:port[:weight[:hash_key]][#model,model...]`` -> Instance (the
        ``--backend`` flag); the models after ``#`` are declared (:mod:`.pools`)."""
        url, _, served = url.partition("#")
        models = tuple(m.strip() for m in served.split(",") if m.strip())
        scheme, sep, rest = url.partition("://")
        if sep and scheme.lower() != "http":
            raise FleetError(
                f"backend {url!r}: only http:// instances are supported (Envoy, the health "
                "checks and the metrics scrapes reach each instance in plain HTTP)"
            )
        rest = (rest if sep else url).rstrip("/")
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            fields = tail.lstrip(":").split(":")
        else:
            host, *fields = rest.split(":")
        if not host or not fields or not fields[0].isdigit():
            raise FleetError(f"backend {url!r} is not of the form [http://]host:port[:weight]")
        weight = int(fields[1]) if len(fields) > 1 and fields[1] else 1
        hash_key = fields[2] if len(fields) > 2 and fields[2] else None
        return cls(
            address=canonical_address(host),
            port=int(fields[0]),
            weight=weight,
            hash_key=hash_key,
            models=models,
        )

    def to_url(self) -> str:
        """The ``--backend`` form of this instance (:meth:`from_url` reads it back)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        url = f"{host}:{self.port}:{self.weight}:{self.hash_key or ''}"
        return url + ("#" + ",".join(self.models) if self.models else "")


def check_ring_keys(instances: list[Instance] | tuple[Instance, ...]) -> None:
    """Two active instances with the same ring key (``hash_key``, else ``address:port``)
    would put the same hashes on Envoy's ring; which one owns them is then up to the order
    Envoy's sort leaves equal entries in, so ext_proc's mirror could not follow. Refused
    where a fleet is written (the admin API, a fleet file, ``--backend``). A draining
    instance is on no ring: its successor may take its ``hash_key`` while it drains."""
    owners: dict[str, str] = {}
    for instance in instances:
        if instance.state is not InstanceState.ACTIVE:
            continue
        other = owners.setdefault(instance.ring_key, instance.id)
        if other != instance.id:
            raise FleetError(
                f"instances {other!r} and {instance.id!r} have the same ring key "
                f"{instance.ring_key!r}: give each its own hash_key"
            )


FLEET_FILE_FIELDS = ("address", "port", "weight", "models", "hash_key")


def _whole_number(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise FleetError(f"{name} must be a whole number, not {value!r}")
    try:
        return int(value)
    except ValueError:
        raise FleetError(f"{name} must be a whole number, not {value!r}") from None


def instance_from_file(entry: Any) -> Instance:
    """One entry of a fleet file's ``instances`` list, typed strictly: a YAML scalar where a
    list belongs (``models: llama``) or a number where a name belongs (``hash_key: 7``) is
    an error naming the field, not a fleet that routes oddly."""
    if not isinstance(entry, dict):
        raise FleetError(f"expected a mapping of {', '.join(FLEET_FILE_FIELDS)}, not {entry!r}")
    unknown = sorted(set(entry) - set(FLEET_FILE_FIELDS))
    if unknown:
        raise FleetError(f"unknown fields {unknown}; known: {', '.join(FLEET_FILE_FIELDS)}")
    if "address" not in entry or "port" not in entry:
        raise FleetError("address and port are required")
    models = entry.get("models") or []
    if not isinstance(models, list):
        raise FleetError(f"models must be a list of names, not {models!r}")
    address = entry["address"]
    if not isinstance(address, str):
        raise FleetError(f"address must be a string, not {address!r}")
    return Instance(
        address=canonical_address(address),
        port=_whole_number(entry["port"], "port"),
        weight=_whole_number(entry.get("weight", 1), "weight"),
        models=tuple(models),
        hash_key=entry.get("hash_key"),
    )


def fleet_from_urls(urls: list[str]) -> Fleet:
    """``--backend`` URLs (:meth:`Instance.from_url`) -> a fleet whose ring keys are distinct."""
    instances = [Instance.from_url(url) for url in urls]
    check_ring_keys(instances)
    return Fleet.of(instances)


def fleet_from_file(data: Any) -> Fleet:
    """A fleet file's ``instances`` (the parsed YAML's list) -> a fleet whose ring keys are
    distinct. Raises :class:`FleetError` naming the entry at fault."""
    if not isinstance(data, list):
        raise FleetError(f"'instances' must be a list, not {data!r}")
    instances = []
    for n, entry in enumerate(data):
        try:
            instances.append(instance_from_file(entry))
        except FleetError as exc:
            raise FleetError(f"instance {n}: {exc}") from None
    check_ring_keys(instances)
    return Fleet.of(instances)


@dataclass(frozen=True, slots=True)
class Fleet:
    """An immutable, versioned set of instances, sorted by id."""

    version: int
    instances: tuple[Instance, ...] = field(default=())

    @classmethod
    def of(cls, instances: list[Instance] | tuple[Instance, ...], version: int = 1) -> Fleet:
        ids = [i.id for i in instances]
        if len(set(ids)) != len(ids):
            raise FleetError(f"duplicate instance ids in {ids}")
        return cls(version=version, instances=tuple(sorted(instances, key=lambda i: i.id)))

    def get(self, instance_id: str) -> Instance | None:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        return None

    @property
    def routable(self) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if i.routable)

    def to_json_dict(self) -> dict[str, Any]:
        return {"version": self.version, "instances": [i.to_json_dict() for i in self.instances]}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Fleet:
        return cls.of(
            [Instance.from_json_dict(d) for d in data.get("instances", [])],
            version=int(data.get("version", 0)),
        )
