"""The routing policies a benchmark compares, and what each one means for the stack.

=================  ===================  ========  ===============================================
policy             Envoy ``lb_policy``  ext_proc  router config
=================  ===================  ========  ===============================================
``round-robin``    ROUND_ROBIN          off       -
``least-request``  LEAST_REQUEST        off       -
``prefix``         RING_HASH            on        defaults, but ``spill: none`` (pure affinity)
``prefix-spill``   RING_HASH            on        the defaults: longest prefix, least work
``prefix-fixed``   RING_HASH            on        the defaults with a fixed 1 KiB key
                                                  (``prefix_match: fixed``, PrefixLength 1024)
``cache-aware``    (simulation only)    off       SGLang model gateway's ``cache_aware`` policy
                                                  with its defaults (:mod:`bench.cache_aware`)
=================  ===================  ========  ===============================================

``all`` means the first four; ``prefix-fixed`` and ``cache-aware`` are asked for by name
(``cache-aware`` is a comparator, not something this stack can run live). The live driver runs
each through the same Envoy, bootstrap and simulated instances (:mod:`bench.live`); the
discrete-event simulation routes with the same code in virtual time (:mod:`bench.des`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from prefix_router.core.config import PrefixMatch, RouterConfig, SpillPolicyName


class Policy(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"
    PREFIX = "prefix"
    PREFIX_SPILL = "prefix-spill"
    PREFIX_FIXED = "prefix-fixed"
    CACHE_AWARE = "cache-aware"

    @property
    def simulated_only(self) -> bool:
        """True for a comparator that only the discrete-event simulation routes with."""
        return self is Policy.CACHE_AWARE

    @property
    def envoy_lb_policy(self) -> str:
        return {
            Policy.ROUND_ROBIN: "ROUND_ROBIN",
            Policy.LEAST_REQUEST: "LEAST_REQUEST",
        }.get(self, "RING_HASH")

    @property
    def uses_router(self) -> bool:
        """True when ext_proc computes a prefix key and Envoy hashes it."""
        return self.envoy_lb_policy == "RING_HASH" and not self.simulated_only

    def router_config(self, base: RouterConfig) -> RouterConfig:
        """``base`` with this policy's changes (see the module docstring)."""
        changes: dict[str, Any] = {}
        if self is Policy.PREFIX:
            changes["spill"] = {"policy": SpillPolicyName.NONE.value}
        elif self is Policy.PREFIX_FIXED:
            changes = {"prefix_match": PrefixMatch.FIXED.value, "prefix_length": 1024}
        return base.patched(changes) if changes else base


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
