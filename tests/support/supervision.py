"""A supervisor's report as ``prefix-router up`` writes it: one process restarting after a
segfault, whose log tail holds markup the status page must show as text."""

from __future__ import annotations

from prefix_router.state.supervision import ComponentReport, SupervisionEvent, SupervisionReport

REPORT = SupervisionReport(
    supervisor_pid=4242,
    updated=1700000000.5,
    components=(
        ComponentReport(name="redis", pid=11, state="running", restarts=0),
        ComponentReport(
            name="envoy",
            pid=12,
            state="starting",
            restarts=2,
            last_exit="killed by SIGSEGV (core dumped)",
            last_exit_time=1699999999.0,
        ),
    ),
    events=(
        SupervisionEvent(
            time=1699999999.0,
            component="envoy",
            kind="exit",
            pid=10,
            status="killed by SIGSEGV (core dumped)",
            uptime_s=61.0,
            restart_in_s=0.5,
            log_tail="Caught Segmentation fault\n<script>alert(1)</script>",
        ),
    ),
)
