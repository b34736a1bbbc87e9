"""vllm_sim: a faithful, cheap stand-in for vLLM's OpenAI server (no GPU needed).

Pure cores, thin shells:

    tokenizer      4-byte stand-in tokenizer and chat template
    prefix_cache   KV block pool with vLLM's automatic prefix caching (hashing, hits, LRU)
    scheduler      continuous batching, chunked prefill, preemption (pure, simulated time)
    config         cost model, engine settings, hardware profiles
    stats          counters and histograms behind /metrics
    engine         the sleeping asyncio step loop around the scheduler
    protocol       request validation;   responses   response bodies and SSE chunks
    faults         runtime fault injection;   instance   one simulated server
    app            the ASGI app (create_app);   server   many instances, one process
    cli            ``python -m vllm_sim`` / ``prefix-router sim``
"""

from vllm_sim.app import create_app
from vllm_sim.config import DEFAULT_PROFILE, PROFILES, CostModel, EngineConfig, make_config
from vllm_sim.engine import Engine, GenerationParams, RequestHandle
from vllm_sim.errors import (
    BadRequestError,
    EngineStoppedError,
    ModelNotFoundError,
    RequestError,
    SimConfigError,
    SimError,
    SimStartupError,
)
from vllm_sim.faults import Fault, FaultMode
from vllm_sim.instance import SimInstance
from vllm_sim.prefix_cache import BlockTable, PrefixCache, hash_blocks, hash_seed
from vllm_sim.scheduler import Scheduler
from vllm_sim.server import SimCluster, serve_instances, start_instances

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "BadRequestError",
    "BlockTable",
    "CostModel",
    "Engine",
    "EngineConfig",
    "EngineStoppedError",
    "Fault",
    "FaultMode",
    "GenerationParams",
    "ModelNotFoundError",
    "PrefixCache",
    "RequestError",
    "RequestHandle",
    "Scheduler",
    "SimCluster",
    "SimConfigError",
    "SimError",
    "SimInstance",
    "SimStartupError",
    "create_app",
    "hash_blocks",
    "hash_seed",
    "make_config",
    "serve_instances",
    "start_instances",
]
