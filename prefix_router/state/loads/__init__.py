"""Fleet-wide in-flight counts: the load view spill decides on.

Two stores share one contract (:class:`LoadStore`), held to it by the same
contract tests:

* :class:`~prefix_router.state.loads.memory.InMemoryLoadStore`: one process, no Redis
  (a single ext_proc replica, the local stack's fallback);
* :class:`~prefix_router.state.loads.redis_store.RedisLoadStore`: counts shared by every
  ext_proc replica through Redis, atomic check-and-reserve in one Lua call.
"""

from prefix_router.state.loads.base import LoadStore, LoadsUnavailable, Reservation
from prefix_router.state.loads.memory import InMemoryLoadStore

__all__ = ["InMemoryLoadStore", "LoadStore", "LoadsUnavailable", "Reservation"]
