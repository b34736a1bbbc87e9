"""ext_proc's Prometheus metrics, read over HTTP from a live process behind real Envoy."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.core.config import MIB
from prefix_router.ops.procs import free_port
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.static_stack import start_static_stack

pytestmark = pytest.mark.e2e


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_decisions_fallbacks_and_streams_are_counted(procs: ProcessReaper, log_dir: Path) -> None:
    metrics_port = free_port()
    stack = start_static_stack(
        procs, log_dir, backends=3, ext_proc_args=["--metrics-port", str(metrics_port)]
    )
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    with httpx.Client(timeout=10) as client:
        for _ in range(7):
            assert client.post(f"{stack.url}/v1/chat/completions", content=chat).status_code == 200
        for _ in range(3):
            assert client.post(f"{stack.url}/v1/chat/completions", content=b"{not json").is_success
        huge = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5 * MIB}]})
        assert client.post(f"{stack.url}/v1/chat/completions", content=huge).status_code == 200
    got = samples(f"http://127.0.0.1:{metrics_port}/metrics")
    # one after another: each of the three keys (chat, invalid JSON, huge) is placed once,
    # then found where it was placed
    assert got[("prefix_router_ext_proc_decisions_total", (("outcome", "placed"),))] == 3
    assert got[("prefix_router_ext_proc_decisions_total", (("outcome", "home"),))] == 8
    assert got[("prefix_router_ext_proc_decisions_total", (("outcome", "spilled"),))] == 0
    assert got[("prefix_router_ext_proc_key_fallbacks_total", (("reason", "invalid_json"),))] == 3
    # Above openai_max_parse_bytes (4 MiB) the body is keyed on its bytes, unparsed.
    assert got[("prefix_router_ext_proc_key_fallbacks_total", (("reason", "too_large"),))] == 1
    assert got[("prefix_router_ext_proc_decision_seconds_count", ())] == 11
    assert got[("prefix_router_ext_proc_open_streams", ())] == 0
    assert got[("prefix_router_ext_proc_stream_ends_total", (("how", "closed"),))] == 11
    assert got[("prefix_router_ext_proc_stream_ends_total", (("how", "reset"),))] == 0
    # Envoy closes every stream gracefully (our bootstrap's runtime flag) and resets none,
    # so no read fails and grpcio leaks nothing (see ext_proc/servicer.py). Without the
    # flag each stream ends with a reset, though the handler may see its half-close first.
    envoy = httpx.get(
        f"http://127.0.0.1:{stack.admin_port}/stats?filter=^cluster.ext_proc.upstream_rq_",
        timeout=5,
    ).text
    stats = dict(line.split(": ", 1) for line in envoy.splitlines() if ": " in line)
    assert stats["cluster.ext_proc.upstream_rq_completed"] == "11"
    assert stats["cluster.ext_proc.upstream_rq_tx_reset"] == "0"
    in_flight = [v for (name, _), v in got.items() if name == "prefix_router_ext_proc_in_flight"]
    assert in_flight and set(in_flight) == {0}


def test_unknown_models_and_each_pools_decisions_are_counted(
    procs: ProcessReaper, log_dir: Path
) -> None:
    metrics_port = free_port()
    stack = start_static_stack(
        procs,
        log_dir,
        backends=3,
        models=[["base-a"], ["base-a", "a-sql"], ["base-b"]],
        ext_proc_args=["--metrics-port", str(metrics_port)],
    )

    def chat(model: str) -> bytes:
        return json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()

    with httpx.Client(timeout=10) as client:
        for model, times in (("base-a", 2), ("a-sql", 3), ("nope", 4)):
            for _ in range(times):
                client.post(f"{stack.url}/v1/chat/completions", content=chat(model))
        assert client.post(f"{stack.url}/v1/embeddings", content=b"not json").status_code == 200
    got = samples(f"http://127.0.0.1:{metrics_port}/metrics")
    assert got[("prefix_router_ext_proc_decisions_total", (("outcome", "unknown_model"),))] == 4
    assert got[("prefix_router_ext_proc_pool_decisions_total", (("pool", "base-a"),))] == 2
    assert got[("prefix_router_ext_proc_pool_decisions_total", (("pool", "a-sql"),))] == 3
    # a body naming no model goes over the whole fleet (pool "")
    assert got[("prefix_router_ext_proc_pool_decisions_total", (("pool", ""),))] == 1
    assert ("prefix_router_ext_proc_pool_decisions_total", (("pool", "nope"),)) not in got


def test_decisions_on_the_replicas_copy_are_counted(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    """With the state in Redis, each decision counts as made at once on the replica's copy
    or after a round trip: the first waits (no copy yet), later ones use the copy."""
    metrics_port = free_port()
    stack = start_static_stack(
        procs,
        log_dir,
        backends=3,
        ext_proc_args=[
            "--metrics-port",
            str(metrics_port),
            "--redis-url",
            REDIS_URL,
            "--namespace",
            namespace,
        ],
    )
    with httpx.Client(timeout=10) as client:
        for n in range(20):
            chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"q{n}"}]})
            assert client.post(f"{stack.url}/v1/chat/completions", content=chat).status_code == 200
    got = samples(f"http://127.0.0.1:{metrics_port}/metrics")
    copy = got[("prefix_router_ext_proc_store_decisions_total", (("how", "copy"),))]
    waited = got[("prefix_router_ext_proc_store_decisions_total", (("how", "round_trip"),))]
    assert copy + waited == 20
    assert waited >= 1 and copy >= 1, (copy, waited)
