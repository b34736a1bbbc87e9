"""prefix-router: prefix-aware routing for fleets of vLLM inference servers.

Layers, each importing only those below it (``make test`` checks this with import-linter):

    prefix_router.ops      operations: ``prefix-router up``, launching processes, the CLI
    ext_proc, control_plane  the two processes (sibling packages; neither imports the other)
    prefix_router.state    I/O adapters: fleet and config in Redis, the load stores
    prefix_router.envoy    Envoy's configuration: bootstrap, the model cluster, addresses
    prefix_router.core     the pure routing core: config, fleet, key, ring, table, decision

``vllm_sim`` (the vLLM simulator) and ``bench`` (benchmarks) sit beside them: nothing of the
router imports either, and the simulator imports nothing of the router.
"""

__version__ = "0.1.0"
