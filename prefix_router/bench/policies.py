"""The routing policies a benchmark compares, and what each one means for the stack.

=================  ===================  ========  =================================
policy             Envoy ``lb_policy``  ext_proc  spill (``RouterConfig.spill``)
=================  ===================  ========  =================================
``round-robin``    ROUND_ROBIN          off       -
``least-request``  LEAST_REQUEST        off       -
``prefix``         RING_HASH            on        ``none``: always the key's home
``prefix-spill``   RING_HASH            on        ``bounded-load`` at ConcurrencyThreshold
=================  ===================  ========  =================================

The live driver runs each through the same Envoy, bootstrap and simulated instances
(:mod:`prefix_router.bench.live`); the discrete-event simulation routes with the same
rules in virtual time (:mod:`prefix_router.bench.des`).
"""

from __future__ import annotations

from enum import StrEnum

from prefix_router.config import RouterConfig, SpillPolicyName


class Policy(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"
    PREFIX = "prefix"
    PREFIX_SPILL = "prefix-spill"

    @property
    def envoy_lb_policy(self) -> str:
        return {
            Policy.ROUND_ROBIN: "ROUND_ROBIN",
            Policy.LEAST_REQUEST: "LEAST_REQUEST",
        }.get(self, "RING_HASH")

    @property
    def uses_router(self) -> bool:
        """True when ext_proc computes a prefix key and Envoy hashes it."""
        return self in (Policy.PREFIX, Policy.PREFIX_SPILL)

    def router_config(self, base: RouterConfig) -> RouterConfig:
        """``base`` with this policy's spill rule."""
        spill = (
            SpillPolicyName.BOUNDED_LOAD if self is Policy.PREFIX_SPILL else SpillPolicyName.NONE
        )
        return base.patched({"spill": {"policy": spill.value}})


ALL_POLICIES: tuple[Policy, ...] = tuple(Policy)


def parse_policies(text: str) -> tuple[Policy, ...]:
    """``"round-robin,prefix"`` -> policies; ``"all"`` -> every policy."""
    if text.strip() == "all":
        return ALL_POLICIES
    try:
        return tuple(Policy(p.strip()) for p in text.split(",") if p.strip())
    except ValueError:
        known = ", ".join(p.value for p in Policy)
        raise ValueError(f"unknown policy in {text!r}; known: {known}, all") from None
