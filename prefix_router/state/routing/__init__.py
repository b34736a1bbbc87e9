"""The fleet's routing state: the prefix index, each instance's modelled prefill queue and
its in-flight count, kept where every ext_proc replica sees it.

Two stores share one contract (:class:`RoutingStore`), held to it by the same contract
tests, and both decide with the one decision function (:func:`prefix_router.core.decision.decide`):

* :class:`~prefix_router.state.routing.memory.InProcessStore`: one process, no Redis (a
  single ext_proc replica, the degraded mode, the discrete-event simulation);
* :class:`~prefix_router.state.routing.redis_store.RedisStore`: shared by every ext_proc
  replica through Redis, one round trip per batch of requests.
"""

from prefix_router.state.routing.base import Routed, RoutingStore, StateUnavailable
from prefix_router.state.routing.memory import InProcessStore

__all__ = ["InProcessStore", "Routed", "RoutingStore", "StateUnavailable"]
