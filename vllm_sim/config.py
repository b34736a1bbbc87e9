"""Simulator settings: a cost model for one engine step and the engine's configuration.

Both are frozen dataclasses validated at construction, so a running engine never sees an
inconsistent setting. ``PROFILES`` holds presets for the hardware the router is sized for;
:func:`make_config` derives a config from a preset plus keyword overrides (every field is
settable, the cost model's fields included).

Step cost model (seconds of simulated time, see :meth:`CostModel.step_seconds`)::

    step = t0                                   # fixed per-step cost (kernel launches, TP sync)
         + prefill_tokens / prefill_tokens_per_s
         + (decode_step_s if any sequence decodes)  # logits + sampling
         + decoding_sequences * decode_s_per_seq
         + context_tokens * attention_s_per_token   # KV read by attention, optional

With the 70B/8xH100 preset a cold 8k-token prompt on an idle instance costs
0.017 + 8192/22000 ~ 0.39 s and one decoding sequence ~ 20 ms per token, as measured on vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_sim.errors import SimConfigError

DEFAULT_MODEL = "meta-llama/Llama-3.1-70B-Instruct"
DEFAULT_PROFILE = "llama-3.1-70b-8xh100"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SimConfigError(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """How long one engine step takes, as a linear function of what the step computes.

    step_overhead_s: t0, paid by every step.
    prefill_tokens_per_s: prompt tokens computed per second (prefill is compute-bound).
    decode_step_s: paid once by a step in which at least one sequence decodes.
    decode_s_per_seq: paid per decoding sequence in the step.
    attention_s_per_token: paid per context token (KV read) of every scheduled sequence.
    """

    step_overhead_s: float
    prefill_tokens_per_s: float
    decode_step_s: float = 0.0
    decode_s_per_seq: float = 0.0
    attention_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        _require(self.prefill_tokens_per_s > 0, "prefill_tokens_per_s must be > 0")
        for name in (
            "step_overhead_s",
            "decode_step_s",
            "decode_s_per_seq",
            "attention_s_per_token",
        ):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0")

    def step_seconds(self, *, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Simulated duration of a step; pure, so tests can compute expected latencies."""
        seconds = self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
        if decode_seqs:
            seconds += self.decode_step_s + decode_seqs * self.decode_s_per_seq
        return seconds + context_tokens * self.attention_s_per_token


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Everything one simulated vLLM instance needs; shared by scheduler, engine and API.

    model: served model name; requests naming another model get 404 (as vLLM does).
    lora_modules: extra served names (LoRA adapters); each seeds the block hashes apart.
    block_size / num_gpu_blocks: KV cache geometry (tokens per block, blocks in the pool).
    max_num_seqs / max_num_batched_tokens: per-step limits of continuous batching.
    max_model_len: longest prompt + completion accepted (capped by the KV pool's size).
    time_scale: wall-clock sleeps are simulated durations divided by this; reported
        latencies and metrics stay in simulated seconds.
    default_max_tokens: completion length limit for chat requests that give none (vLLM
        would allow the whole context; the simulator keeps runs bounded).
    """

    model: str = DEFAULT_MODEL
    lora_modules: tuple[str, ...] = ()
    block_size: int = 16
    num_gpu_blocks: int = 81_000
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    enable_prefix_caching: bool = True
    cost: CostModel = field(
        default_factory=lambda: CostModel(step_overhead_s=0.017, prefill_tokens_per_s=22_000.0)
    )
    time_scale: float = 1.0
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        _require(bool(self.model), "model must be a non-empty name")
        _require(self.model not in self.lora_modules, "a LoRA name repeats the model name")
        _require(len(set(self.lora_modules)) == len(self.lora_modules), "duplicate LoRA name")
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "default_max_tokens",
        ):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1")
        _require(math.isfinite(self.time_scale) and self.time_scale > 0, "time_scale must be > 0")

    @property
    def served_models(self) -> tuple[str, ...]:
        """Names a request's ``model`` may take: the base model, then the LoRA adapters."""
        return (self.model, *self.lora_modules)

    @property
    def effective_max_model_len(self) -> int:
        """Longest sequence accepted: one request must always fit in the KV pool alone."""
        return min(self.max_model_len, self.num_gpu_blocks * self.block_size)


_COST_FIELDS = frozenset(f.name for f in dataclasses.fields(CostModel))

PROFILES: Mapping[str, EngineConfig] = MappingProxyType(
    {
        # 8xH100 TP8, BF16: ~22k prompt tok/s, ~20 ms/token at light load, ~1.3M KV tokens.
        "llama-3.1-70b-8xh100": EngineConfig(
            model="meta-llama/Llama-3.1-70B-Instruct",
            num_gpu_blocks=81_000,
            cost=CostModel(
                step_overhead_s=0.017,
                prefill_tokens_per_s=22_000.0,
                decode_step_s=0.0025,
                decode_s_per_seq=0.00015,
                # 320 KiB of KV per token spread over 8 GPUs at ~3.35 TB/s each.
                attention_s_per_token=1.2e-8,
            ),
        ),
        # 1xH100: ~30k prompt tok/s, ~7 ms/token at light load, ~0.4M KV tokens.
        "llama-3.1-8b-1xh100": EngineConfig(
            model="meta-llama/Llama-3.1-8B-Instruct",
            num_gpu_blocks=25_000,
            cost=CostModel(
                step_overhead_s=0.0065,
                prefill_tokens_per_s=30_000.0,
                decode_step_s=0.0005,
                decode_s_per_seq=0.00005,
                # 128 KiB of KV per token at ~3.35 TB/s.
                attention_s_per_token=3.9e-8,
            ),
        ),
    }
)


def make_config(profile: str | EngineConfig = DEFAULT_PROFILE, **overrides: Any) -> EngineConfig:
    """A profile (by name or value) with ``overrides`` applied; cost fields may be given flat.

    ``make_config("llama-3.1-8b-1xh100", time_scale=100, prefill_tokens_per_s=25_000)``
    Unknown names raise :class:`SimConfigError`, so a typo never silently keeps a default.
    """
    if isinstance(profile, str):
        if profile not in PROFILES:
            known = ", ".join(sorted(PROFILES))
            raise SimConfigError(f"unknown profile {profile!r}; known: {known}")
        base = PROFILES[profile]
    else:
        base = profile
    cost_overrides = {k: v for k, v in overrides.items() if k in _COST_FIELDS}
    config_overrides = {k: v for k, v in overrides.items() if k not in _COST_FIELDS}
    known_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(config_overrides) - known_fields)
    if unknown:
        raise SimConfigError(f"unknown setting(s): {', '.join(unknown)}")
    if cost_overrides:
        config_overrides["cost"] = dataclasses.replace(base.cost, **cost_overrides)
    return dataclasses.replace(base, **config_overrides)
