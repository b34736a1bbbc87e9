"""Give Redis back the shared state it lost.

Redis is the source of truth for the fleet and the config, but ``prefix-router
up`` runs it without persistence, and any Redis may restart empty or be flushed.
Left alone, every reader would then see no documents: the admin API an empty
fleet, a restarted ext_proc no instance to route to. The control plane holds
the last state it read or wrote (the admin API's, the health prober's and model
discovery's writes share its store), so it writes it back, versions kept, within
``interval_s`` (:meth:`~prefix_router.state.store.StateStore.restore`; only
where a document is absent, so several replicas restoring at once, or an admin
change made meanwhile, are safe: such a change starts from the store's last read of
the document, not from an empty one). Readers ignore the absent documents in the
meantime (:func:`~prefix_router.state.store.watch_state`).

What is not restored: the audit log before the loss, and the routing state's
keys (in-flight counts, decision counts, spills, the prefix index, prefill
queues), which the ext_proc replicas rebuild as they go (each rewrites its exact
share of the in-flight counts after a failed round trip; releases of requests
counted before the loss never take a count below zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prefix_router.state.store import StateError, StateStore

log = logging.getLogger("prefix_router.control_plane")


class StateKeeper:
    """Restores the fleet and config documents its store last read or wrote when Redis
    no longer has them.

    Not a copy of its own, refreshed once per ``interval_s``: a write made by the same
    process in the moment before the loss would then be restored away, the fleet's
    version going back under snapshots Envoy already has."""

    def __init__(self, store: StateStore, *, interval_s: float = 1.0) -> None:
        self.store = store
        self.interval_s = interval_s
        self.restored = 0
        """Times this replica wrote lost documents back."""

    async def check(self) -> bool:
        """Read once; restore what went missing. Returns whether this call restored
        anything. Raises :class:`StateError` if Redis fails."""
        state = await self.store.read()
        fleet, config = self.store.newest()
        lost_fleet = state.fleet.fleet.version == 0 and fleet is not None
        lost_config = state.config.version == 0 and config is not None
        if not (lost_fleet or lost_config):
            return False
        restored = await self.store.restore(
            fleet if lost_fleet else None, config if lost_config else None
        )
        if restored:
            self.restored += 1
            log.warning(
                "Redis lost the shared state (restarted empty?): restored %s",
                ", ".join(
                    f"{name} v{version}"
                    for name, version, lost in (
                        ("fleet", fleet.fleet.version if fleet else 0, lost_fleet),
                        ("config", config.version if config else 0, lost_config),
                    )
                    if lost
                ),
            )
        return restored

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval_s`` until ``stop`` is set; Redis errors are retried."""
        while not stop.is_set():
            with contextlib.suppress(StateError, TimeoutError):
                async with asyncio.timeout(max(self.interval_s, 2.0)):
                    await self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


__all__ = ["StateKeeper"]
