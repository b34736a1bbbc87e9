"""Instances named by DNS, published to Envoy as IP literals.

Envoy takes endpoint addresses as IP literals only (a name in EDS is NACKed as a
"malformed IP address"), but fleets are found by name: a Kubernetes StatefulSet's
``vllm-0.vllm.ns.svc``, a compose service's ``vllm-1``. So an instance's address may
be a name; whoever writes Envoy's config (the control plane, or the static bootstrap)
resolves it and publishes the IP, with the endpoint's ``envoy.lb`` ``hash_key`` set to
the instance's id (``name:port``). Envoy hashes that id for the instance's ring entries,
and so does ext_proc's mirror (:attr:`Instance.ring_key`), so the ring, and every
key's home, stay put when a pod comes back under a new IP.

A name that does not resolve is left out of Envoy's view (and of the ring size) until
it does; the health prober marks it unhealthy meanwhile, which takes it out of
ext_proc's ring too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping

from prefix_router.core.fleet import Fleet, Instance

log = logging.getLogger("prefix_router.envoy.addresses")

Addresses = Mapping[str, str]
"""DNS name -> the IP literal it resolved to."""


def is_ip_literal(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def names_in(fleet: Fleet) -> frozenset[str]:
    """The instance addresses that are DNS names, not IP literals."""
    return frozenset(i.address for i in fleet.instances if not is_ip_literal(i.address))


def published_address(instance: Instance, addresses: Addresses) -> str | None:
    """The IP Envoy should connect to, or None while the name has not resolved."""
    if is_ip_literal(instance.address):
        return instance.address
    return addresses.get(instance.address)


def publishable(fleet: Fleet, addresses: Addresses) -> Fleet:
    """``fleet`` without the instances whose name has not resolved (same version)."""
    kept = tuple(i for i in fleet.instances if published_address(i, addresses) is not None)
    if len(kept) == len(fleet.instances):
        return fleet
    return Fleet(version=fleet.version, instances=kept)


def _pick(infos: Iterable[tuple[object, ...]]) -> str | None:
    """IPv4 before IPv6 (``localhost`` may answer ``::1`` first; loopback listeners
    are usually IPv4), otherwise the resolver's order."""
    found = [str(info[4][0]) for info in infos]  # type: ignore[index]
    v4 = [a for a in found if "." in a]
    preferred = v4 or found
    return preferred[0] if preferred else None


async def resolve(names: Iterable[str], *, timeout_s: float = 2.0) -> dict[str, str]:
    """Resolve every name concurrently; a name that fails or times out is left out."""
    loop = asyncio.get_running_loop()
    names = sorted(set(names))

    async def one(name: str) -> str | None:
        try:
            async with asyncio.timeout(timeout_s):
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError, UnicodeError) as exc:  # UnicodeError: no DNS name
            log.warning("cannot resolve instance address %r: %s", name, exc)
            return None
        return _pick(infos)

    answers = await asyncio.gather(*(one(n) for n in names))
    return {n: a for n, a in zip(names, answers, strict=True) if a is not None}


def resolve_now(names: Iterable[str]) -> dict[str, str]:
    """Blocking :func:`resolve`, for rendering a static bootstrap."""
    out = {}
    for name in sorted(set(names)):
        try:
            address = _pick(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            log.warning("cannot resolve instance address %r: %s", name, exc)
            continue
        if address is not None:
            out[name] = address
    return out
