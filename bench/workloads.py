"""Seeded workload generators: who shares which prefix, and when requests arrive.

Every generator takes a frozen parameter object and returns a :class:`Workload` whose
arrivals come at ``rate`` requests per model-second. The same parameters (seed included)
always give the same workload, byte for byte.

=====================  ======================================================================
``system-prompt``      a few long system prompts, short user turns
``rag``                a pool of long documents, many questions per document (Zipf popularity)
``chat``               multi-turn conversations; each turn resends the conversation so far
``code``               code completion: a file's content as context, an edited region at its end
``unique``             every prompt unique from its first byte: routing cannot help
``hot-prefix``         system prompts where one prompt carries ``hot_share`` of the traffic
``long-system-chat``   one system prompt of ~1,800 tokens shared by 600 conversations of
                       6 turns (the shared head is longer than a fixed key's 1 KiB)
``trace-like``         shaped like a public production trace of multi-turn chat: every
                       request starts with the same 512-token (2 KB) block, conversations
                       diverge after it, user turns and conversation lengths are
                       heavy-tailed, arrivals come in bursts
``group-prompts``      128 groups x 16 prompts, a 4,096-token system prompt per group
                       (16 KiB: a fixed key shorter than that sees only the group), short
                       user turns; load, not the key, is what this one tests
``mixed``              one fleet serving several of the above at once (by default
                       trace-like conversations, RAG, system prompts, code and unique
                       prompts), all bursty, all with heavy-tailed outputs: one set of
                       defaults must suit every kind of traffic at the same time
=====================  ======================================================================

Two options every workload shares (:class:`Common`), because they decide whether a
router's load signal is right:

``outputs``
    ``uniform`` (``output_min`` .. ``output_max``) or ``lognormal``: median
    ``output_median``, log-space deviation ``output_sigma``, capped at ``output_cap``
    (at 256 and 1.0: mean ~420 tokens, 1% above ~2,600). Real outputs are heavy-tailed,
    so decoding dominates the time a request is in flight. The three new workloads use
    ``lognormal``; the older ones keep ``uniform`` so their results stay comparable.
``arrivals`` / ``burstiness``
    ``poisson``, or ``gamma``: gaps between arrivals drawn from a gamma distribution of
    the same mean whose coefficient of variation is ``burstiness`` (1 is Poisson; 2
    packs arrivals into clumps, with the variance of the count in a window ~4x
    Poisson's). ``trace-like`` is bursty by default.

Sizes are in tokens of the simulator's tokenizer (4 bytes each). Each workload is built so
its requests differ within the first 1024 bytes of the rendered prompt (the default
PrefixLength) exactly where their cacheable prefixes differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from bench.spec import Arrival, Turn, Workload
from bench.text import BYTES_PER_TOKEN, filler

OUTPUTS = ("uniform", "lognormal")
ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True, kw_only=True)
class Common:
    requests: int = 2000
    """Requests in the run (conversation turns count one each)."""
    rate: float = 8.0
    """Arrivals of requests per model-second, fleet-wide."""
    seed: int = 1
    arrivals: str = "poisson"
    """``poisson`` or ``gamma`` (gaps with coefficient of variation ``burstiness``)."""
    burstiness: float = 2.0
    """``gamma`` arrivals: coefficient of variation of the gaps (1: as Poisson)."""
    outputs: str = "uniform"
    """``uniform`` (``output_min`` .. ``output_max``) or ``lognormal``."""
    output_min: int = 64
    output_max: int = 256
    output_median: int = 256
    """``lognormal`` outputs: the median (at least ``output_min``, at most ``output_cap``)."""
    output_sigma: float = 1.0
    """``lognormal`` outputs: standard deviation of the log of the length."""
    output_cap: int = 4096

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate <= 0:
            raise ValueError("requests must be >= 1 and rate > 0")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError("need 1 <= output_min <= output_max")
        if self.outputs not in OUTPUTS or self.arrivals not in ARRIVALS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, arrivals one of {ARRIVALS}")
        if self.burstiness <= 0 or self.output_sigma < 0:
            raise ValueError("need burstiness > 0 and output_sigma >= 0")
        if not self.output_min <= self.output_median <= self.output_cap:
            raise ValueError("need output_min <= output_median <= output_cap")


@dataclass(frozen=True, kw_only=True)
class SystemPromptParams(Common):
    prompts: int = 48
    prompt_tokens: int = 6000
    user_min: int = 40
    user_max: int = 200
    skew: float = 0.0
    """Zipf exponent of prompt popularity (0: uniform)."""


@dataclass(frozen=True, kw_only=True)
class HotPrefixParams(SystemPromptParams):
    hot_share: float = 0.5
    """Fraction of all requests that use prompt 0."""
    user_min: int = 1000
    user_max: int = 2000
    output_min: int = 32
    output_max: int = 64


@dataclass(frozen=True, kw_only=True)
class RagParams(Common):
    docs: int = 96
    doc_tokens: int = 4000
    instruction_tokens: int = 48
    question_min: int = 15
    question_max: int = 60
    skew: float = 0.3


@dataclass(frozen=True, kw_only=True)
class ChatParams(Common):
    system_tokens: int = 100
    turns_min: int = 3
    turns_max: int = 8
    user_min: int = 50
    user_max: int = 300
    think_mean_s: float = 10.0


@dataclass(frozen=True, kw_only=True)
class CodeParams(Common):
    files: int = 48
    file_min: int = 2000
    file_max: int = 6000
    edit_min: int = 8
    edit_max: int = 64
    """Tokens of the edited region at the end of the file, new in every request."""
    keep: float = 0.5
    """Probability that an edit stays in the file (later requests share it)."""
    growth_max: int = 2000
    """Tokens a file may grow by through kept edits."""
    skew: float = 0.8
    output_min: int = 16
    output_max: int = 64


@dataclass(frozen=True, kw_only=True)
class UniqueParams(Common):
    prompt_min: int = 1000
    prompt_max: int = 6000


@dataclass(frozen=True, kw_only=True)
class LongSystemChatParams(ChatParams):
    requests: int = 3600
    system_tokens: int = 1800
    turns_min: int = 6
    turns_max: int = 6
    outputs: str = "lognormal"
    output_min: int = 16


@dataclass(frozen=True, kw_only=True)
class TraceLikeParams(Common):
    """Conversations after one shared 512-token block, heavy-tailed in every dimension."""

    requests: int = 3000
    block_tokens: int = 512
    """The block every request starts with (the system message)."""
    turns_mean: float = 2.5
    """Mean turns of a conversation: 1 + geometric, so most are short, a few long."""
    turns_max: int = 12
    user_median: int = 1000
    user_sigma: float = 1.0
    user_cap: int = 8000
    """User turns in tokens: lognormal (median, log deviation), capped."""
    think_mean_s: float = 20.0
    arrivals: str = "gamma"
    outputs: str = "lognormal"
    output_min: int = 16


@dataclass(frozen=True, kw_only=True)
class GroupPromptsParams(Common):
    requests: int = 2048
    groups: int = 128
    per_group: int = 16
    """Requests per group in each round: every group comes ``per_group`` times in a
    shuffled round of ``groups x per_group`` requests (the run repeats rounds)."""
    prompt_tokens: int = 4096
    user_min: int = 40
    user_max: int = 200
    outputs: str = "lognormal"
    output_min: int = 16


@dataclass(frozen=True, kw_only=True)
class MixedParams(Common):
    """Several workloads on one fleet at once. Each arrival is one part's next request or
    conversation, drawn by the parts' shares; the parts keep their own prefixes and sizes
    (their defaults, their pools scaled by ``pool_scale``), and the mix sets what traffic
    has in common: one arrival process (so every part sends until the run ends, and bursts
    hit all of them), the seed and the output lengths."""

    requests: int = 4000
    parts: str = "trace-like:0.4,rag:0.2,system-prompt:0.2,code:0.1,unique:0.1"
    """``workload:share`` pairs: each part's expected share of the requests (conversation
    turns count one each; shares are normalized)."""
    pool_scale: float = 1.0
    """Multiplies each part's pool of prompts, documents, files or groups."""
    think_mean_s: float = 0.0
    """Think time between a conversation's turns (0: each part's own default)."""
    arrivals: str = "gamma"
    outputs: str = "lognormal"
    output_min: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pool_scale <= 0 or self.think_mean_s < 0:
            raise ValueError("need pool_scale > 0 and think_mean_s >= 0")
        mix_parts(self.parts)


POOLS = ("prompts", "docs", "files", "groups")
"""The fields that size a workload's pool of shared prefixes (``MixedParams.pool_scale``)."""


def mix_parts(spec: str) -> list[tuple[str, float]]:
    """``workload:share`` pairs of a mix, shares normalized to sum to 1."""
    parts: list[tuple[str, float]] = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, share = item.partition(":")
        try:
            weight = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"mixed: share of {name!r} is not a number: {share!r}") from None
        if name not in WORKLOADS or name == "mixed":
            known = ", ".join(w for w in WORKLOADS if w != "mixed")
            raise ValueError(f"mixed: unknown part {name!r}; known: {known}")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"mixed: share of {name!r} must be > 0, got {share!r}")
        if name in (n for n, _ in parts):
            raise ValueError(f"mixed: part {name!r} given twice")
        parts.append((name, weight))
    if not parts:
        raise ValueError("mixed: no parts")
    total = sum(w for _, w in parts)
    return [(name, w / total) for name, w in parts]


def mean_turns(params: Common) -> float:
    """Requests per arrival a workload sends on average: its conversations' mean turns."""
    if isinstance(params, TraceLikeParams):
        return params.turns_mean
    if isinstance(params, ChatParams):
        return (params.turns_min + params.turns_max) / 2
    return 1.0


def _part_params(p: MixedParams, name: str) -> Common:
    """Part ``name`` of the mix: its own defaults, sized and shaped by the mix."""
    cls = WORKLOADS[name][0]
    defaults = vars(cls())
    overrides: dict[str, Any] = {f.name: getattr(p, f.name) for f in dataclasses.fields(Common)}
    overrides.update({k: max(1, round(defaults[k] * p.pool_scale)) for k in POOLS if k in defaults})
    if p.think_mean_s and "think_mean_s" in defaults:
        overrides["think_mean_s"] = p.think_mean_s
    return cls(**overrides)


def _mixed(p: MixedParams) -> Iterator[Arrival]:
    """Arrivals at the mix's rate of requests, each drawn from a part with probability
    ``share / mean turns`` (so the parts' shares of requests are their shares), carrying
    that part's next arrival's requests; the last is cut to ``requests``."""
    rng = random.Random(f"{p.seed}:mixed")
    parts = [(name, share, _part_params(p, name)) for name, share in mix_parts(p.parts)]
    weights = [share / mean_turns(params) for _, share, params in parts]
    streams = [iter(WORKLOADS[name][1](params)) for name, _, params in parts]
    per_arrival = 1.0 / sum(weights)  # the mean turns of an arrival of the mix
    remaining = p.requests
    for t in _arrival_times(rng, p.rate / per_arrival, p):
        i = rng.choices(range(len(parts)), weights)[0]
        arrival = next(streams[i])
        turns = arrival.turns[:remaining]
        remaining -= len(turns)
        yield Arrival(arrival_s=t, group=f"{parts[i][0]}/{arrival.group}", turns=turns)
        if remaining <= 0:
            return


# -- shared pieces --------------------------------------------------------------------------


def _arrival_times(rng: random.Random, rate: float, p: Common) -> Iterator[float]:
    """Arrival times at ``rate`` a second: Poisson, or gamma gaps of the same mean whose
    coefficient of variation is ``p.burstiness`` (shape ``1 / burstiness**2``)."""
    t = 0.0
    if p.arrivals == "gamma":
        shape = 1.0 / p.burstiness**2
        scale = 1.0 / (rate * shape)
        while True:
            t += rng.gammavariate(shape, scale)
            yield t
    while True:
        t += rng.expovariate(rate)
        yield t


def _popularity(count: int, skew: float) -> list[float]:
    """Cumulative Zipf weights over ``count`` items."""
    return list(itertools.accumulate(1.0 / (i + 1) ** skew for i in range(count)))


def _output(rng: random.Random, p: Common) -> int:
    if p.outputs == "lognormal":
        return _lognormal(rng, p.output_median, p.output_sigma, p.output_min, p.output_cap)
    return rng.randint(p.output_min, p.output_max)


def _lognormal(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    """A heavy-tailed length: lognormal around ``median``, clamped to ``low .. high``."""
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def _single(t: float, group: str, turn: Turn) -> Arrival:
    return Arrival(arrival_s=t, group=group, turns=(turn,))


# -- generators -----------------------------------------------------------------------------


def _system_prompt(p: SystemPromptParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:system-prompt")
    prompts = [filler(f"{p.seed}:system:{i}", p.prompt_tokens) for i in range(p.prompts)]
    weights = _popularity(p.prompts, p.skew)
    for n, t in zip(range(p.requests), _arrival_times(rng, p.rate, p), strict=False):
        i = rng.choices(range(p.prompts), cum_weights=weights)[0]
        question = filler(f"{p.seed}:user:{n}", rng.randint(p.user_min, p.user_max))
        turn = Turn(
            max_tokens=_output(rng, p), messages=(("system", prompts[i]), ("user", question))
        )
        yield _single(t, f"system-{i}", turn)


def _hot_prefix(p: HotPrefixParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:hot-prefix")
    prompts = [filler(f"{p.seed}:hot:{i}", p.prompt_tokens) for i in range(p.prompts)]
    for n, t in zip(range(p.requests), _arrival_times(rng, p.rate, p), strict=False):
        i = 0 if rng.random() < p.hot_share else rng.randrange(1, p.prompts)
        question = filler(f"{p.seed}:user:{n}", rng.randint(p.user_min, p.user_max))
        turn = Turn(
            max_tokens=_output(rng, p), messages=(("system", prompts[i]), ("user", question))
        )
        yield _single(t, "hot" if i == 0 else f"system-{i}", turn)


def _rag(p: RagParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:rag")
    instruction = "Answer from the document only. " + filler(
        f"{p.seed}:instruction", p.instruction_tokens
    )
    docs = [filler(f"{p.seed}:doc:{i}", p.doc_tokens) for i in range(p.docs)]
    weights = _popularity(p.docs, p.skew)
    for n, t in zip(range(p.requests), _arrival_times(rng, p.rate, p), strict=False):
        d = rng.choices(range(p.docs), cum_weights=weights)[0]
        question = filler(f"{p.seed}:question:{n}", rng.randint(p.question_min, p.question_max))
        content = f"<document id={d}>\n{docs[d]}\n</document>\nQuestion: {question}"
        turn = Turn(
            max_tokens=_output(rng, p), messages=(("system", instruction), ("user", content))
        )
        yield _single(t, f"doc-{d}", turn)


def _chat(p: ChatParams, name: str = "chat") -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:{name}")
    system = "You are a helpful assistant. " + filler(f"{p.seed}:{name}-system", p.system_tokens)
    mean_turns = (p.turns_min + p.turns_max) / 2
    remaining = p.requests
    for c, t in enumerate(_arrival_times(rng, p.rate / mean_turns, p)):
        if remaining <= 0:
            return
        count = min(remaining, rng.randint(p.turns_min, p.turns_max))
        turns = []
        for k in range(count):
            user = filler(f"{p.seed}:{name}:{c}:{k}", rng.randint(p.user_min, p.user_max))
            messages = (("system", system), ("user", user)) if k == 0 else (("user", user),)
            think = 0.0 if k == 0 else rng.expovariate(1.0 / p.think_mean_s)
            turns.append(Turn(max_tokens=_output(rng, p), messages=messages, think_s=think))
        remaining -= count
        yield Arrival(arrival_s=t, group=f"chat-{c}", turns=tuple(turns))


def _code(p: CodeParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:code")
    bodies = [
        f"# file: src/module_{i}.py\n"
        + filler(f"{p.seed}:file:{i}", rng.randint(p.file_min, p.file_max))
        for i in range(p.files)
    ]
    limits = [len(b) + p.growth_max * BYTES_PER_TOKEN for b in bodies]
    weights = _popularity(p.files, p.skew)
    for n, t in zip(range(p.requests), _arrival_times(rng, p.rate, p), strict=False):
        f = rng.choices(range(p.files), cum_weights=weights)[0]
        edit = "\n" + filler(f"{p.seed}:edit:{n}", rng.randint(p.edit_min, p.edit_max))
        turn = Turn(max_tokens=_output(rng, p), prompt=bodies[f] + edit)
        if rng.random() < p.keep and len(bodies[f]) + len(edit) <= limits[f]:
            bodies[f] += edit  # the edit stays: later requests on this file start with it
        yield _single(t, f"file-{f}", turn)


def _unique(p: UniqueParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:unique")
    for n, t in zip(range(p.requests), _arrival_times(rng, p.rate, p), strict=False):
        prompt = filler(f"{p.seed}:unique:{n}", rng.randint(p.prompt_min, p.prompt_max))
        turn = Turn(max_tokens=_output(rng, p), messages=(("user", prompt),))
        yield _single(t, f"unique-{n}", turn)


def _trace_like(p: TraceLikeParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:trace-like")
    block = filler(f"{p.seed}:trace-block", p.block_tokens)
    stop = 1.0 / p.turns_mean  # 1 + geometric turns: P(another turn) = 1 - stop
    remaining = p.requests
    for c, t in enumerate(_arrival_times(rng, p.rate / p.turns_mean, p)):
        if remaining <= 0:
            return
        count = 1
        while count < min(p.turns_max, remaining) and rng.random() >= stop:
            count += 1
        turns = []
        for k in range(count):
            size = _lognormal(rng, p.user_median, p.user_sigma, 1, p.user_cap)
            user = filler(f"{p.seed}:trace:{c}:{k}", size)
            messages = (("system", block), ("user", user)) if k == 0 else (("user", user),)
            think = 0.0 if k == 0 else rng.expovariate(1.0 / p.think_mean_s)
            turns.append(Turn(max_tokens=_output(rng, p), messages=messages, think_s=think))
        remaining -= count
        yield Arrival(arrival_s=t, group=f"conversation-{c}", turns=tuple(turns))


def _group_prompts(p: GroupPromptsParams) -> Iterator[Arrival]:
    rng = random.Random(f"{p.seed}:group-prompts")
    prompts = [filler(f"{p.seed}:group:{g}", p.prompt_tokens) for g in range(p.groups)]
    order: list[int] = []
    for n, t in zip(range(p.requests), _arrival_times(rng, p.rate, p), strict=False):
        if not order:
            order = [g for g in range(p.groups) for _ in range(p.per_group)]
            rng.shuffle(order)
        g = order.pop()
        question = filler(f"{p.seed}:group-user:{n}", rng.randint(p.user_min, p.user_max))
        turn = Turn(
            max_tokens=_output(rng, p), messages=(("system", prompts[g]), ("user", question))
        )
        yield _single(t, f"group-{g}", turn)


def system_prompt(p: SystemPromptParams) -> Workload:
    return Workload("system-prompt", p.requests, lambda: _system_prompt(p))


def hot_prefix(p: HotPrefixParams) -> Workload:
    if not 0.0 <= p.hot_share <= 1.0 or p.prompts < 2:
        raise ValueError("hot-prefix needs 0 <= hot_share <= 1 and prompts >= 2")
    return Workload("hot-prefix", p.requests, lambda: _hot_prefix(p))


def rag(p: RagParams) -> Workload:
    return Workload("rag", p.requests, lambda: _rag(p))


def chat(p: ChatParams) -> Workload:
    if not 1 <= p.turns_min <= p.turns_max:
        raise ValueError("need 1 <= turns_min <= turns_max")
    return Workload("chat", p.requests, lambda: _chat(p))


def long_system_chat(p: LongSystemChatParams) -> Workload:
    if not 1 <= p.turns_min <= p.turns_max:
        raise ValueError("need 1 <= turns_min <= turns_max")
    return Workload("long-system-chat", p.requests, lambda: _chat(p, "long-system-chat"))


def trace_like(p: TraceLikeParams) -> Workload:
    if p.turns_mean < 1 or p.turns_max < 1 or not 1 <= p.user_median <= p.user_cap:
        raise ValueError("need turns_mean >= 1, turns_max >= 1, 1 <= user_median <= user_cap")
    return Workload("trace-like", p.requests, lambda: _trace_like(p))


def group_prompts(p: GroupPromptsParams) -> Workload:
    if p.groups < 1 or p.per_group < 1:
        raise ValueError("need groups >= 1 and per_group >= 1")
    return Workload("group-prompts", p.requests, lambda: _group_prompts(p))


def mixed(p: MixedParams) -> Workload:
    return Workload("mixed", p.requests, lambda: _mixed(p))


def code(p: CodeParams) -> Workload:
    return Workload("code", p.requests, lambda: _code(p))


def unique(p: UniqueParams) -> Workload:
    return Workload("unique", p.requests, lambda: _unique(p))


Generator = Callable[[Any], Workload]

WORKLOADS: Mapping[str, tuple[type[Common], Generator]] = {
    "system-prompt": (SystemPromptParams, system_prompt),
    "rag": (RagParams, rag),
    "chat": (ChatParams, chat),
    "code": (CodeParams, code),
    "unique": (UniqueParams, unique),
    "hot-prefix": (HotPrefixParams, hot_prefix),
    "long-system-chat": (LongSystemChatParams, long_system_chat),
    "trace-like": (TraceLikeParams, trace_like),
    "group-prompts": (GroupPromptsParams, group_prompts),
    "mixed": (MixedParams, mixed),
}


def make_params(name: str, overrides: Mapping[str, str | int | float] | None = None) -> Common:
    """The parameters of workload ``name`` with ``overrides`` (strings are converted)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name][0]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in (overrides or {}).items():
        key = key.replace("-", "_")
        if key not in fields:
            raise ValueError(
                f"workload {name!r} has no parameter {key!r}; known: {', '.join(sorted(fields))}"
            )
        kind = type(fields[key].default)
        if kind in (int, float) and isinstance(raw, str | int):
            raw = kind(raw)
        values[key] = raw
    return cls(**values)


def generate(name: str, overrides: Mapping[str, str | int | float] | None = None) -> Workload:
    """Build workload ``name`` (see :data:`WORKLOADS`) with parameter ``overrides``."""
    return WORKLOADS[name][1](make_params(name, overrides))


def describe(params: Common) -> str:
    """``name=value`` for every parameter, for reports."""
    return ", ".join(f"{f.name}={getattr(params, f.name)}" for f in dataclasses.fields(params))
