"""Benchmarks of routing policies: live through the real stack, or in virtual time.

spec          what a request is: arrivals, turns, the body bytes (shared by all)
text          deterministic filler text sized in simulator tokens
workloads     seeded generators: system-prompt, rag, chat, code, unique, hot-prefix
trace         JSONL trace replay (Mooncake / LMCache format)
bounds        offline hit-rate bounds: infinite cache, one fleet-sized LRU
policies      round-robin, least-request, prefix, prefix-spill
driver        open-loop async HTTP driver (streaming, TTFT, e2e, errors)
fleet_metrics vLLM /metrics counters before and after, in-flight sampler
live          one workload x policy through the real stack over simulated instances
des           discrete-event simulation with the same routing and instance code
results       what a run measured; JSON persistence
report        markdown tables, PNG plots, the issue's goals
cli           ``prefix-router bench run | des | drive | report``
"""
