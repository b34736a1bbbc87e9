"""Fleet faults under load through the xDS stack: the router keeps serving.

Control plane killed and restarted, an instance killed, the fleet resized:
zero failed requests, and keys move only as far as the change requires.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from prefix_router.core.config import RouterConfig
from prefix_router.core.fleet import Instance
from prefix_router.core.ring import Ring, ring_size_for
from tests.conftest import ProcessReaper
from tests.support.figures import report
from tests.support.load import Load
from tests.support.wait import wait_until
from tests.support.xds_stack import XdsStack, start_xds_stack

pytestmark = pytest.mark.e2e

PROMPTS = [f"placement probe {i}" for i in range(600)]


def placement(stack: XdsStack) -> dict[str, str]:
    """Which backend serves each probe prompt right now."""
    out: dict[str, str] = {}
    with httpx.Client(timeout=10) as client:
        for prompt in PROMPTS:
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})
            r = client.post(f"{stack.url}/v1/chat/completions", content=body)
            assert r.status_code == 200, r.text
            out[prompt] = r.json()["backend"]
    return out


def routable_in_envoy(stack: XdsStack, host: str) -> bool:
    """Envoy would pick ``host``: present, EDS-healthy, passing health checks, not ejected."""
    status = stack.envoy_hosts().get(host)
    if status is None:
        return False
    health = status.get("health_status", {})
    return health.get("eds_health_status", "HEALTHY") == "HEALTHY" and not any(
        health.get(flag)
        for flag in (
            "failed_active_health_check",
            "failed_outlier_check",
            "pending_dynamic_removal",
        )
    )


def ring_share(members: list[str], owners: list[str]) -> float:
    """Exact share of the key space ``owners`` hold on the ring of ``members``."""
    hosts = [Instance.from_url(m) for m in members]
    share = Ring.build(hosts, minimum_ring_size=ring_size_for(hosts, 256)).share()
    return sum(share[o] for o in owners)


def moved(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str, str]]:
    return {p: (before[p], after[p]) for p in before if before[p] != after[p]}


def test_control_plane_killed_and_restarted_changes_nothing(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    config = RouterConfig.model_validate({"spill": {"policy": "none"}})  # about placement
    stack, _ = start_xds_stack(procs, log_dir, namespace, backends=3, config=config)
    before = placement(stack)
    with Load(stack.url) as load:
        assert stack.control_plane is not None
        stack.control_plane.kill()
        killed = time.monotonic()
        # Envoy and ext_proc keep serving with the last config while it is away.
        wait_until(lambda: not stack.control_plane_connected(), 30, "Envoy saw it go")
        wait_until(lambda: served_since(load, killed) >= 100, 60, "100 requests without it")
        restarted = time.monotonic()
        stack.start_control_plane(procs)
        serving = time.monotonic() - restarted
        with stack.admin() as admin:
            wait_until(
                lambda: any(c.get("acked") for c in admin.get("/status").json()["xds_clients"]),
                30,
                "Envoy reconnected and ACKed",
            )
        reconnected = time.monotonic()
        wait_until(lambda: served_since(load, reconnected) >= 20, 30, "20 requests after")
    report(
        "control plane killed",
        sent=len(load.outcomes),
        failed=len(load.failures()),
        control_plane_serving_s=round(serving, 2),
        envoy_acked_s=round(reconnected - restarted, 2),
    )
    assert load.failures() == []
    assert moved(before, placement(stack)) == {}


def healthy_in_fleet(stack: XdsStack, port: int) -> bool:
    with stack.admin() as admin:
        fleet = admin.get("/instances").json()
    return any(i["port"] == port and i["healthy"] for i in fleet["instances"])


def served_since(load: Load, moment: float) -> int:
    return sum(1 for o in load.outcomes if o.started >= moment and o.status == 200)


def test_a_killed_instance_is_taken_out_and_only_its_keys_move(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    # spill: none keeps this about placement: the probes' tiny prefills would otherwise now
    # and then find their holder still computing the previous probe and go to an idle one
    config = RouterConfig.model_validate({"spill": {"policy": "none"}})
    stack, _ = start_xds_stack(
        procs, log_dir, namespace, backends=4, backend_processes=True, config=config
    )
    before = placement(stack)
    victim = stack.backend_ports[1]
    with Load(stack.url) as load:
        wait_until(lambda: len(load.outcomes) >= 20, 30, "the load runs")
        stack.backend_procs[victim].kill()  # returns once the process is reaped
        killed = time.monotonic()
        taken_out = wait_until(
            lambda: not routable_in_envoy(stack, f"127.0.0.1:{victim}"),
            30,
            "Envoy took the dead instance out",
            interval=0.05,
        )
        out_at = time.monotonic()
        wait_until(lambda: served_since(load, out_at) >= 50, 30, "50 requests after")
        # The control plane's prober marks it unhealthy too; ext_proc's mirror follows.
        wait_until(lambda: not healthy_in_fleet(stack, victim), 30, "the fleet marks it down")
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet without it")
    report(
        "instance killed",
        sent=len(load.outcomes),
        failed=len(load.failures()),
        taken_out_s=round(taken_out, 2),
    )
    # New requests never fail: connect failures are retried along the ring. Only a request
    # already on the wire to the instance when it died may fail (it is not safe to retry).
    late = [o for o in load.failures() if o.started > killed + 0.05]
    assert late == [], late[:3]
    assert len(load.failures()) <= load.workers, load.failures()
    after = placement(stack)
    changes = moved(before, after)
    assert {old for old, _ in changes.values()} == {str(victim)}
    assert len(changes) == sum(1 for b in before.values() if b == str(victim))


def test_resize_under_load_fails_nothing_and_moves_only_the_prefixes_of_who_left(
    namespace: str, procs: ProcessReaper, log_dir: Path
) -> None:
    """Prefixes stay where their cache is: instances that join take new prefixes (and load)
    but no held prefix moves to them; instances that leave give up exactly their own.
    (The probes are sent one at a time, so load does not move them: spill is about load,
    and ``spill: none`` keeps this test about placement.)"""
    config = RouterConfig.model_validate({"spill": {"policy": "none"}})
    stack, _ = start_xds_stack(
        procs, log_dir, namespace, backends=4, spare_backends=2, config=config,
        extra_cp_args=["--drain-grace", "1.0"],
    )  # fmt: skip
    original, spare = stack.backend_ports[:4], stack.backend_ports[4:]
    with Load(stack.url) as load, stack.admin() as admin:
        p4 = placement(stack)
        for port in spare:
            assert admin.post("/instances", json={"address": "127.0.0.1", "port": port}).is_success
        wait_until(lambda: len(stack.envoy_hosts()) == 6, 30, "Envoy has 6 hosts")
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet of 6")
        p6 = placement(stack)
        for port in original[:2]:
            assert admin.delete(f"/instances/127.0.0.1:{port}").status_code == 202
        wait_until(lambda: len(stack.envoy_hosts()) == 4, 30, "the drained instances are gone")
        wait_until(stack.converged, 30, "Envoy and ext_proc run the fleet of 4")
        p4b = placement(stack)
    grown, shrunk = moved(p4, p6), moved(p6, p4b)
    left = {str(p) for p in original[:2]}
    held_by_left = {prompt for prompt, backend in p6.items() if backend in left}
    report(
        "resize 4 -> 6 -> 4",
        sent=len(load.outcomes),
        failed=len(load.failures()),
        moved_on_add=f"{len(grown) / len(PROMPTS):.3f} (consistent hashing: {2 / 6:.3f})",
        moved_on_remove=f"{len(shrunk) / len(PROMPTS):.3f} (held there: "
        f"{len(held_by_left) / len(PROMPTS):.3f})",
    )
    assert load.failures() == [], load.failures()[:3]
    assert grown == {}, list(grown.items())[:5]  # every prefix kept its cache
    assert set(shrunk) == held_by_left and 0.2 < len(held_by_left) / len(PROMPTS) < 0.8
    assert {new for _, new in shrunk.values()} <= {str(p) for p in (*original[2:], *spare)}
