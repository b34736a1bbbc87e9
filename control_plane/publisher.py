"""From shared state to the snapshot cache: build, check, publish.

:class:`Publisher` is the ``on_change`` of :func:`prefix_router.state.watch_state`:
every (fleet, config) version read from Redis becomes one snapshot, checked
with ``consistent()`` before Envoys see it. A snapshot that cannot be built or
is inconsistent is logged and not published; Envoys keep the last good one.

Versions only grow. A state older than the one published means Redis lost
data (a flush, a failover to a stale replica), so it is refused rather than,
say, publishing an empty fleet to every Envoy; a restarted control plane
re-seeds an empty namespace from its start-up files.
"""

from __future__ import annotations

import logging
import time

from control_plane.cache import ALL_NODES, SnapshotCache
from control_plane.snapshot import Snapshot, build_snapshot
from prefix_router.config import RouterConfig
from prefix_router.errors import PrefixRouterError
from prefix_router.fleet import Fleet

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
        try:
            snapshot = build_snapshot(fleet, config, config_version=config_version)
            snapshot.consistent()
        except (PrefixRouterError, ValueError) as exc:
            log.error("not publishing fleet %d / config %d: %s", fleet.version, config_version, exc)
            return
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
