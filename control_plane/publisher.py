"""From shared state to the snapshot cache: build, check, publish.

:class:`Publisher` is the ``on_change`` of :func:`prefix_router.state.store.watch_state`:
every (fleet, config) version read from Redis becomes one snapshot, checked
with ``consistent()`` before Envoys see it. A snapshot that cannot be built or
is inconsistent is logged and not published; Envoys keep the last good one.

Instances named by DNS are published with the IPs :func:`keep_names_resolved` found
for them (re-resolved every few seconds, at once when a new name appears); a changed
answer republishes the same fleet under a new snapshot version.

Versions only grow. A state older than the one published means Redis lost
data (a flush, a failover to a stale replica), so it is refused rather than,
say, publishing an empty fleet to every Envoy; a restarted control plane
re-seeds an empty namespace from its start-up files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace

from control_plane.cache import ALL_NODES, SnapshotCache
from control_plane.snapshot import Snapshot, build_snapshot
from prefix_router.core.config import RouterConfig
from prefix_router.core.errors import PrefixRouterError
from prefix_router.core.fleet import Fleet
from prefix_router.envoy.addresses import Addresses, names_in, resolve

log = logging.getLogger("prefix_router.control_plane")


class Publisher:
    def __init__(
        self,
        cache: SnapshotCache,
        *,
        key: str = ALL_NODES,
    ) -> None:
        self.cache = cache
        self.key = key
        self.published: Snapshot | None = None
        self.published_at = 0.0
        self.fleet: Fleet | None = None
        self.config: RouterConfig | None = None
        self.config_version = 0
        self.addresses: Addresses = {}
        self.names_to_resolve = asyncio.Event()
        """Set when the fleet names an instance whose address is not known yet."""

    def names(self) -> frozenset[str]:
        """The DNS names the current fleet uses."""
        return names_in(self.fleet) if self.fleet is not None else frozenset()

    def on_addresses(self, addresses: Addresses) -> None:
        """New answers for the fleet's names: republish if any IP changed."""
        if dict(addresses) == dict(self.addresses):
            return
        log.info("instance names resolved: %s", dict(sorted(addresses.items())))
        self.addresses = dict(addresses)
        if self.fleet is not None and self.config is not None:
            self._publish(self.fleet, self.config, self.config_version)

    def on_state(self, fleet: Fleet, config: RouterConfig, config_version: int) -> None:
        if self.fleet is not None and (
            fleet.version < self.fleet.version or config_version < self.config_version
        ):
            log.error(
                "shared state went back (fleet %d -> %d, config %d -> %d): Redis lost data? "
                "keeping snapshot %s",
                self.fleet.version,
                fleet.version,
                self.config_version,
                config_version,
                self.published.version if self.published else None,
            )
            return
        if not names_in(fleet) <= set(self.addresses):
            self.names_to_resolve.set()
        self._publish(fleet, config, config_version)

    def _publish(self, fleet: Fleet, config: RouterConfig, config_version: int) -> None:
        try:
            snapshot = build_snapshot(
                fleet, config, config_version=config_version, addresses=self.addresses
            )
            snapshot.consistent()
        except (PrefixRouterError, ValueError) as exc:
            log.error("not publishing fleet %d / config %d: %s", fleet.version, config_version, exc)
            return
        published = self.published
        if published is not None and snapshot.version == published.version:
            if snapshot.resources != published.resources:
                # The versions came back to one already published with other content
                # (Redis went back, then forward). Envoy skips a version it has, so this
                # one is told apart by its content.
                snapshot = replace(snapshot, version=f"{snapshot.version}.{snapshot.digest()}")
        elif (
            published is not None
            and published.version.startswith(snapshot.version + ".")
            and snapshot.resources == published.resources
        ):
            return  # published already, under the version its content told apart
        self.fleet, self.config, self.config_version = fleet, config, config_version
        self.cache.set_snapshot(self.key, snapshot)
        self.published = snapshot
        self.published_at = time.time()
        log.info(
            "published snapshot %s: %d instances, %d routable",
            snapshot.version,
            len(fleet.instances),
            len(fleet.routable),
        )


Resolver = Callable[[Iterable[str]], Awaitable[dict[str, str]]]


async def keep_names_resolved(
    publisher: Publisher,
    stop: asyncio.Event,
    *,
    interval_s: float = 10.0,
    resolver: Resolver = resolve,
) -> None:
    """Resolve the fleet's DNS names at once when a new one appears and every
    ``interval_s`` after (a restarted pod may come back under a new IP).

    A name whose lookup fails keeps the address it last had: dropping it would take the
    instance off Envoy's ring (keys moving) while ext_proc's mirror, which knows nothing
    of DNS, keeps it, until the next round. Envoy's health checks judge the old address."""
    while not stop.is_set():
        publisher.names_to_resolve.clear()
        names = publisher.names()
        if names:
            answers = await resolver(names)
            kept = {n: a for n, a in publisher.addresses.items() if n in names}
            publisher.on_addresses({**kept, **answers})
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, publisher.names_to_resolve)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
