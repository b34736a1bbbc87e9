"""The snapshot cache: the latest snapshot per node group, and who to tell when it changes.

The ADS server sees only :class:`ConfigWatcher` (``fetch`` + ``subscribe``),
so another cache (per-node snapshots, a linear cache) can replace this one
without touching the server. Nodes map to a group key through a one-method
``NodeHash``; prefix-router gives every Envoy the same snapshot
(:func:`fleet_wide`), while per-node keys (:func:`by_node_id`) stay possible.

``set_snapshot`` never mutates a published snapshot; it replaces it and calls
every subscriber of that key. Subscribers fetch the latest snapshot when they
run, so a burst of changes costs one response per stream, not one per change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from envoy.config.core.v3 import base_pb2

from control_plane.snapshot import Snapshot

ALL_NODES = "*"

NodeHash = Callable[[base_pb2.Node], str]
Notify = Callable[[], None]
Cancel = Callable[[], None]


def fleet_wide(node: base_pb2.Node) -> str:
    """Every Envoy runs the same snapshot."""
    return ALL_NODES


def by_node_id(node: base_pb2.Node) -> str:
    return str(node.id)


class ConfigWatcher(Protocol):
    """What the ADS server needs from a cache."""

    def fetch(self, node: base_pb2.Node) -> Snapshot | None:
        """The snapshot ``node`` should run now, if any."""
        ...

    def subscribe(self, node: base_pb2.Node, notify: Notify) -> Cancel:
        """Call ``notify`` whenever ``node``'s snapshot changes, until cancelled."""
        ...


class SnapshotCache:
    def __init__(self, node_hash: NodeHash = fleet_wide) -> None:
        self._node_hash = node_hash
        self._snapshots: dict[str, Snapshot] = {}
        self._watchers: dict[str, set[Notify]] = {}

    def set_snapshot(self, key: str, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` for group ``key``; call ``consistent()`` first."""
        self._snapshots[key] = snapshot
        for notify in list(self._watchers.get(key, ())):
            notify()

    def get_snapshot(self, key: str) -> Snapshot | None:
        return self._snapshots.get(key)

    def fetch(self, node: base_pb2.Node) -> Snapshot | None:
        return self._snapshots.get(self._node_hash(node))

    def subscribe(self, node: base_pb2.Node, notify: Notify) -> Cancel:
        key = self._node_hash(node)
        self._watchers.setdefault(key, set()).add(notify)

        def cancel() -> None:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(notify)
                if not watchers:
                    del self._watchers[key]

        return cancel


_: ConfigWatcher = SnapshotCache()
