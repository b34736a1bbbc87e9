"""prefix-router: prefix-aware routing for fleets of vLLM inference servers.

The shared core lives here: the one config model, the prefix key, Envoy's ring
mirror, the routing decision and the process helpers. The I/O shells live in
the sibling packages ``ext_proc`` (Envoy External Processing server),
``control_plane`` (xDS + admin API) and ``vllm_sim`` (the vLLM simulator).
"""

__version__ = "0.1.0"
