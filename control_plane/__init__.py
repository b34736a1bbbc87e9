"""prefix-router's control plane: xDS (ADS) for Envoy and the admin API.

Data flow: admin API -> :class:`~control_plane.service.AdminService` -> Redis
(``prefix_router.state.store``) -> :func:`~prefix_router.state.store.watch_state` ->
:class:`~control_plane.publisher.Publisher` -> :func:`~control_plane.snapshot.build_snapshot`
-> :class:`~control_plane.cache.SnapshotCache` -> :class:`~control_plane.ads.AdsServer`
-> every Envoy. ext_proc follows the same Redis state, so its ring mirror
matches what Envoy is sent.
"""

from control_plane.ads import AdsServer
from control_plane.cache import ConfigWatcher, SnapshotCache
from control_plane.callbacks import Callbacks, ClientRegistry
from control_plane.snapshot import Snapshot, build_snapshot, snapshot_version

__all__ = [
    "AdsServer",
    "Callbacks",
    "ClientRegistry",
    "ConfigWatcher",
    "Snapshot",
    "SnapshotCache",
    "build_snapshot",
    "snapshot_version",
]
