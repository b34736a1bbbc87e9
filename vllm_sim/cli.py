"""Command line: ``python -m vllm_sim`` / ``prefix-router sim`` -> :func:`main`.

    python -m vllm_sim --instances 4 --base-port 8001 --profile llama-3.1-70b-8xh100 \\
        --time-scale 10

Exit codes: 0 after a clean shutdown (SIGINT/SIGTERM), 1 if an instance cannot start (port
taken), 2 for invalid settings.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from vllm_sim.config import DEFAULT_PROFILE, PROFILES, make_config
from vllm_sim.errors import SimConfigError, SimStartupError
from vllm_sim.server import serve_instances

# CLI flag -> (EngineConfig/CostModel field, conversion from the flag's unit)
_SCALED_FLAGS: dict[str, tuple[str, Callable[[float], float]]] = {
    "step_overhead_ms": ("step_overhead_s", lambda v: v / 1e3),
    "decode_step_ms": ("decode_step_s", lambda v: v / 1e3),
    "decode_ms_per_seq": ("decode_s_per_seq", lambda v: v / 1e3),
    "attention_ns_per_token": ("attention_s_per_token", lambda v: v / 1e9),
    "prefill_tokens_per_s": ("prefill_tokens_per_s", lambda v: v),
}
_PLAIN_FLAGS = (
    "model",
    "block_size",
    "num_gpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "default_max_tokens",
    "enable_prefix_caching",
)


def _ports(text: str) -> list[int]:
    try:
        ports = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated port list: {text!r}") from None
    if not ports or any(not 0 <= p <= 65535 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be in 0..65535: {text!r}")
    return ports


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-sim",
        description="Simulated vLLM servers (OpenAI API, prefix cache, vLLM metrics), "
        "one port per instance, all in one process.",
    )
    p.add_argument("--instances", type=int, default=4, help="number of instances (default 4)")
    p.add_argument(
        "--base-port",
        type=int,
        default=8001,
        help="first port; instances take consecutive ports (0: any free ports)",
    )
    p.add_argument(
        "--ports",
        type=_ports,
        default=None,
        help="comma-separated ports, one instance each (overrides the two above)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="divide every simulated duration by this when sleeping (default 1)",
    )
    p.add_argument("--model", default=None, help="served model name (default: the profile's)")
    p.add_argument(
        "--lora-modules", default="", help="comma-separated extra served names (LoRA adapters)"
    )
    p.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="MODEL[,ADAPTER...]",
        help="what one instance serves: its base model, then LoRA adapters; "
        "repeat per instance (cycled over the instances in port order)",
    )
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of chat requests that give none",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--prefill-tokens-per-s", type=float, default=None)
    p.add_argument("--step-overhead-ms", type=float, default=None, help="t0 of every step")
    p.add_argument(
        "--decode-step-ms",
        type=float,
        default=None,
        help="extra cost of a step with decoding sequences",
    )
    p.add_argument("--decode-ms-per-seq", type=float, default=None)
    p.add_argument("--attention-ns-per-token", type=float, default=None)
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument(
        "--api-key",
        default=None,
        help="the /v1 routes want 'Authorization: Bearer KEY', as vLLM's --api-key",
    )
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides for the flags that were given (others keep the profile's values)."""
    out: dict[str, Any] = {}
    for name in _PLAIN_FLAGS:
        value = getattr(args, name)
        if value is not None:
            out[name] = value
    for flag, (field_name, convert) in _SCALED_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            out[field_name] = convert(value)
    loras = tuple(name.strip() for name in args.lora_modules.split(",") if name.strip())
    if loras:
        out["lora_modules"] = loras
    return out


def _run(coro: Coroutine[Any, Any, None], loop_kind: str) -> None:
    factory = None
    if loop_kind in ("auto", "uvloop"):
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            if loop_kind == "uvloop":
                raise
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides = overrides_from(args)
        make_config(args.profile, time_scale=args.time_scale, **overrides)  # validate early
        serve = [tuple(n.strip() for n in spec.split(",") if n.strip()) for spec in args.serve]
        if any(not served for served in serve):
            raise SimConfigError("--serve needs a model name")
        _run(
            serve_instances(
                host=args.host,
                base_port=args.base_port,
                count=args.instances,
                ports=args.ports,
                profile=args.profile,
                time_scale=args.time_scale,
                serve=serve,
                api_key=args.api_key,
                **overrides,
            ),
            args.loop,
        )
    except SimConfigError as exc:
        print(f"vllm-sim: invalid settings: {exc}", file=sys.stderr)
        return 2
    except SimStartupError as exc:
        print(f"vllm-sim: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
