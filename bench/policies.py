"""The routing policies a benchmark compares, and what each one means for the stack.

=====================  ===================  ========  ==========================================
policy                 Envoy ``lb_policy``  ext_proc  spill (``RouterConfig.spill``)
=====================  ===================  ========  ==========================================
``round-robin``        ROUND_ROBIN          off       -
``least-request``      LEAST_REQUEST        off       -
``prefix``             RING_HASH            on        ``none``: always the prefix's home
``prefix-spill``       RING_HASH            on        ``bounded-load`` at ConcurrencyThreshold
``prefix-relative``    RING_HASH            on        ``relative-load`` (load_factor x mean)
``prefix-spill-ring``  RING_HASH            on        ``bounded-load``; new prefixes start on
                                                      the ring's pick (``placement: home``)
=====================  ===================  ========  ==========================================

Every ``prefix*`` policy but ``prefix-spill-ring`` places new prefixes as the base config
says (by default ``least-loaded``). ``all`` means the first four; ``prefix-relative``
(spill above load_factor x the fleet's mean in flight, a bound that follows the load) and
``prefix-spill-ring`` (pure consistent hashing with spill, to show what placement adds) are
asked for by name.

The live driver runs each through the same Envoy, bootstrap and simulated instances
(:mod:`bench.live`); the discrete-event simulation routes with the same
rules in virtual time (:mod:`bench.des`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from prefix_router.core.config import PlacementPolicyName, RouterConfig, SpillPolicyName


class Policy(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"
    PREFIX = "prefix"
    PREFIX_SPILL = "prefix-spill"
    PREFIX_RELATIVE = "prefix-relative"
    PREFIX_SPILL_RING = "prefix-spill-ring"

    @property
    def envoy_lb_policy(self) -> str:
        return {
            Policy.ROUND_ROBIN: "ROUND_ROBIN",
            Policy.LEAST_REQUEST: "LEAST_REQUEST",
        }.get(self, "RING_HASH")

    @property
    def uses_router(self) -> bool:
        """True when ext_proc computes a prefix key and Envoy hashes it."""
        return self.envoy_lb_policy == "RING_HASH"

    def router_config(self, base: RouterConfig) -> RouterConfig:
        """``base`` with this policy's spill rule (and placement, for ``prefix-spill-ring``)."""
        spill = {
            Policy.PREFIX_SPILL: SpillPolicyName.BOUNDED_LOAD,
            Policy.PREFIX_RELATIVE: SpillPolicyName.RELATIVE_LOAD,
            Policy.PREFIX_SPILL_RING: SpillPolicyName.BOUNDED_LOAD,
        }.get(self, SpillPolicyName.NONE)
        changes: dict[str, Any] = {"spill": {"policy": spill.value}}
        if self is Policy.PREFIX_SPILL_RING:
            changes["placement"] = {"policy": PlacementPolicyName.HOME.value}
        return base.patched(changes)


ALL_POLICIES: tuple[Policy, ...] = (
    Policy.ROUND_ROBIN,
    Policy.LEAST_REQUEST,
    Policy.PREFIX,
    Policy.PREFIX_SPILL,
)


def parse_policies(text: str) -> tuple[Policy, ...]:
    """``"round-robin,prefix"`` -> policies; ``"all"`` (alone or in a list) -> the four."""
    out: list[Policy] = []
    for name in filter(None, (p.strip() for p in text.split(","))):
        try:
            chosen = ALL_POLICIES if name == "all" else (Policy(name),)
        except ValueError:
            known = ", ".join(p.value for p in Policy)
            raise ValueError(f"unknown policy in {text!r}; known: {known}, all") from None
        out += [p for p in chosen if p not in out]
    return tuple(out)
