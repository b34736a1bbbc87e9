"""The one configuration model of prefix-router.

Every setting that changes how requests are routed lives in :class:`RouterConfig`:
the prefix key (PrefixLength, mode, match, tenant header), the prefix index, the
placement of new prefixes, the load rule (ConcurrencyThreshold and spill policy), what
is assumed of an instance until its metrics tell, the ring sizing and the Envoy
cluster's health checking, outlier detection, circuit breakers and retries. The same
model validates the YAML file at start-up, the admin API's PUT/PATCH bodies and
what ext_proc reads back from Redis, so an invalid value is rejected in one
place with one message.

Models are frozen: a config is a value. Changing it means building a new one
(:meth:`RouterConfig.patched`), which is validated as a whole before it exists.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from prefix_router.core.errors import ConfigError

MIB = 1024 * 1024
DEFAULT_OPENAI_MAX_PARSE_BYTES = 4 * MIB
UINT32_MAX = 2**32 - 1
"""Envoy's circuit-breaker thresholds are 32-bit: a larger one could never be published."""
RETRY_CONDITIONS = frozenset(
    {
        "5xx", "gateway-error", "reset", "reset-before-request", "connect-failure",
        "envoy-ratelimited", "retriable-4xx", "refused-stream", "retriable-status-codes",
        "retriable-headers", "http3-post-connect-failure",
        "cancelled", "deadline-exceeded", "internal", "resource-exhausted", "unavailable",
    }
)  # fmt: skip
"""The ``retry_on`` conditions Envoy's router knows (HTTP and gRPC)."""


class PrefixMode(StrEnum):
    """How the prefix key is derived from a request body."""

    BYTES = "bytes"
    """The first PrefixLength bytes of the raw body."""
    OPENAI = "openai"
    """The first PrefixLength bytes of a canonical rendering of an OpenAI request."""


class PrefixMatch(StrEnum):
    """How much of the prompt the key stands for."""

    LONGEST = "longest"
    """Chained blocks up to PrefixLength: the longest prefix some instance holds wins."""
    FIXED = "fixed"
    """One key of exactly the first PrefixLength bytes (the reference product's rule)."""


class SpillPolicyName(StrEnum):
    """Whether load can take a request away from the instances holding its prefix."""

    LEAST_WORK = "least-work"
    """The candidate with the shortest expected wait for the first token (queued prefill
    plus the request's own uncached prefill), among those not overloaded."""
    NONE = "none"
    """Always the instance holding the longest prefix (pure affinity)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


class SpillConfig(_Frozen):
    """When a prefix's holders are busy, whether the request may go elsewhere."""

    policy: SpillPolicyName = SpillPolicyName.LEAST_WORK
    load_factor: float = Field(
        1.4,
        gt=1.0,
        le=100.0,
        description="No instance takes new requests above load_factor x the fleet's mean "
        "in-flight + 2 while another candidate can.",
    )
    miss_weight: float = Field(
        100.0,
        ge=1.0,
        le=10_000.0,
        description="Prefill a request would compute beyond the least any candidate needs "
        "counts this many times in its score: it also delays the requests that queue "
        "behind it (1: only the request's own wait; 100: a holder keeps its requests "
        "unless its queue is 100x what its cache saves, and the in-flight bound spreads "
        "load).",
    )
    idle_miss_weight: float = Field(
        10.0,
        ge=1.0,
        le=10_000.0,
        description="What a miss counts instead while the fleet has prefill to spare: when "
        "the median candidate has nothing queued. It rises linearly to miss_weight as that "
        "queue reaches busy_backlog_ms (never above miss_weight), so a burst on one "
        "instance spills to idle ones while a busy fleet keeps every request on its cache.",
    )
    busy_backlog_ms: float = Field(
        200.0,
        gt=0.0,
        le=600_000.0,
        description="Prefill queued on the median candidate at which a miss counts the "
        "whole miss_weight.",
    )


class PlacementConfig(_Frozen):
    """Where a prefix nobody holds starts: the least loaded of its first ``width`` ring
    candidates (1: the ring's pick, pure consistent hashing). Its later requests follow it
    there through the prefix index."""

    width: int = Field(
        8, ge=1, le=16, description="Ring candidates a prefix nobody holds may start on."
    )


class IndexConfig(_Frozen):
    """The prefix index: which instance recently computed which prompt blocks."""

    block_bytes: int = Field(
        512,
        ge=64,
        le=MIB,
        description="Bytes of the rendered prompt per block (512 B: about 128 tokens).",
    )
    slots_log2: int = Field(
        18,
        ge=10,
        le=26,
        description="The index holds 4 x 2**slots_log2 entries in 32 x 2**slots_log2 bytes "
        "(8 MiB at 18); size it to at least the fleet's KV cache tokens / 128 blocks.",
    )


class InstanceDefaults(_Frozen):
    """What the router assumes of an instance until its vLLM metrics tell (the control
    plane learns each instance's prefill rate and KV cache size from its /metrics)."""

    prefill_tokens_per_s: float = Field(
        8000.0, gt=0, le=1e9, description="Prompt tokens one instance computes a second."
    )
    kv_cache_tokens: int = Field(
        400_000, ge=1000, le=1_000_000_000, description="Tokens one instance's KV cache holds."
    )


class RingConfig(_Frozen):
    """Envoy ring-hash sizing.

    Each instance gets ``entries_per_weight x weight`` entries, whatever the fleet size,
    so a membership change moves only the keys of the instance that came or went.
    """

    entries_per_weight: int = Field(256, ge=16, le=4096)


class HealthCheckConfig(_Frozen):
    """Envoy active health checking against each instance's ``/health``."""

    path: str = Field(
        "/health",
        max_length=1024,
        pattern=r"^/[!-~]*$",
        description="Absolute path, printable ASCII without spaces.",
    )
    interval_ms: int = Field(1000, ge=50, le=600_000)
    timeout_ms: int = Field(500, ge=10, le=60_000)
    unhealthy_threshold: int = Field(2, ge=1, le=100)
    healthy_threshold: int = Field(1, ge=1, le=100)


class OutlierDetectionConfig(_Frozen):
    """Envoy outlier detection: eject an instance that keeps answering 5xx."""

    consecutive_5xx: int = Field(5, ge=1, le=1000)
    interval_ms: int = Field(1000, ge=10, le=600_000)
    base_ejection_time_ms: int = Field(5000, ge=10, le=3_600_000)
    max_ejection_percent: int = Field(50, ge=0, le=100)


class CircuitBreakerConfig(_Frozen):
    """Envoy circuit-breaker limits for the model-serving cluster, and for the ext_proc
    cluster, where every request in flight holds one stream."""

    max_connections: int = Field(100_000, ge=1, le=UINT32_MAX)
    max_pending_requests: int = Field(100_000, ge=1, le=UINT32_MAX)
    max_requests: int = Field(100_000, ge=1, le=UINT32_MAX)
    max_retries: int = Field(16, ge=0, le=UINT32_MAX)


class RetryConfig(_Frozen):
    """Envoy retry policy.

    The default retries only failures that happen before the request reached an
    instance (connect failure, refused stream, reset before the request), which
    are safe for streaming and non-idempotent generations alike. Adding ``5xx``
    or ``reset`` to ``retry_on`` may run a generation twice.
    """

    enabled: bool = True
    num_retries: int = Field(2, ge=0, le=10)
    retry_on: str = "connect-failure,refused-stream,reset-before-request"
    per_try_timeout_ms: int = Field(0, ge=0, le=86_400_000, description="0: no per-try timeout.")

    @field_validator("retry_on")
    @classmethod
    def _known_conditions(cls, value: str) -> str:
        """Envoy ignores a condition it does not know (with a warning in its log): a typo
        would silently retry less than asked."""
        unknown = [c for c in value.split(",") if c.strip() not in RETRY_CONDITIONS]
        if unknown:
            known = ", ".join(sorted(RETRY_CONDITIONS))
            raise ValueError(f"unknown retry condition(s) {unknown}; known: {known}")
        return ",".join(c.strip() for c in value.split(","))


class RouterConfig(_Frozen):
    """Everything that decides where a request goes. One validated, versioned value."""

    prefix_length: int = Field(
        32 * 1024,
        ge=1,
        le=MIB,
        description="PrefixLength: the most bytes of the (rendered) prompt the key covers.",
    )
    prefix_mode: PrefixMode = PrefixMode.OPENAI
    prefix_match: PrefixMatch = PrefixMatch.LONGEST
    openai_max_parse_bytes: int = Field(
        DEFAULT_OPENAI_MAX_PARSE_BYTES,
        ge=64 * 1024,
        le=64 * MIB,
        description="openai mode: larger bodies are keyed on their raw bytes, unparsed "
        "(parsing is the one cost that grows with the whole body).",
    )
    tenant_header: str | None = Field(
        "x-tenant-id", description="Header whose value scopes the key; null disables tenancy."
    )
    concurrency_threshold: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="ConcurrencyThreshold: requests waiting for their first token at which an "
        "instance is overloaded and takes no new request while another candidate can "
        "(decoding requests do not count; the router's count, or the instance's own "
        "vllm:num_requests_waiting if it reports more). null (the default): no such "
        "limit; the in-flight "
        "bound (spill.load_factor) spreads load.",
    )

    @field_validator("concurrency_threshold", mode="before")
    @classmethod
    def _threshold_off(cls, value: Any) -> Any:
        """``off`` or ``none`` (any case) from a flag or an env var: no threshold."""
        if isinstance(value, str) and value.strip().lower() in ("off", "none", "null", ""):
            return None
        return value

    spill: SpillConfig = SpillConfig()
    placement: PlacementConfig = PlacementConfig()
    index: IndexConfig = IndexConfig()
    instance_defaults: InstanceDefaults = InstanceDefaults()
    ring: RingConfig = RingConfig()
    health_check: HealthCheckConfig = HealthCheckConfig()
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    circuit_breakers: CircuitBreakerConfig = CircuitBreakerConfig()
    retry: RetryConfig = RetryConfig()
    redis_timeout_ms: float = Field(
        100.0,
        gt=0,
        le=1000,
        description="Longest one Redis round trip may take; past it ext_proc routes on its "
        "own counts and leaves Redis alone for a short back-off.",
    )
    redis_max_staleness_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="How old the copy of the fleet-wide routing state an ext_proc replica "
        "decides on may be. Each replica keeps a copy (the prefix index, every instance's "
        "queue and counts) that each Redis round trip refreshes, and decides at once while "
        "it was refreshed within this many ms; past that a request waits for a round trip. "
        "0: every decision waits for one. Only for an index of at most 2**20 slots.",
    )

    @model_validator(mode="before")
    @classmethod
    def _explain_retired_settings(cls, data: Any) -> Any:
        """Settings of 0.1 that no longer exist get a message saying what replaced them."""
        if isinstance(data, dict):
            for section, name, why in _RETIRED:
                value = data.get(section)
                if isinstance(value, dict) and name in value:
                    raise ValueError(f"{section}.{name} was retired: {why}")
            policy = (
                data.get("spill", {}).get("policy") if isinstance(data.get("spill"), dict) else None
            )
            if policy in ("bounded-load", "relative-load"):
                raise ValueError(
                    f"spill.policy {policy!r} was retired: load is now measured in prefill work "
                    "(use 'least-work', the default, or 'none')"
                )
        return data

    @field_validator("tenant_header")
    @classmethod
    def _lowercase_header(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.replace("-", "").replace("_", "").isalnum():
            raise ValueError("tenant_header must be a header name (letters, digits, '-', '_')")
        return value.lower()

    def patched(self, changes: dict[str, Any]) -> RouterConfig:
        """A new config with ``changes`` merged in (nested dicts merge), validated whole."""
        merged = _deep_merge(self.model_dump(mode="json"), changes)
        return parse_config(merged)

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


_RETIRED = (
    ("placement", "policy", "use placement.width 1 for the ring's pick"),
    ("placement", "memory_s", "the prefix index forgets by each instance's KV cache size"),
)


def parse_config(data: Any) -> RouterConfig:
    """Validate ``data`` into a :class:`RouterConfig`, raising :class:`ConfigError` with reasons."""
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field.path: message``."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _deep_merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config_file(path: str) -> RouterConfig:
    """A :class:`RouterConfig` from a YAML file (its ``routing:`` section, or the whole file)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    section = data.get("routing", data)
    return parse_config(section)
