"""The status page in a real headless Chromium against the running stack.

Redis, simulated vLLM, control plane, ext_proc and Envoy run as ``prefix-router up`` runs
them. The page must ask for the token, show every instance with its key-space share, load
against the threshold, hit rate and TTFT, and follow a config change and a new instance
without a reload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from prefix_router.core.decision import IN_FLIGHT_SLACK
from prefix_router.state.supervision import write_report
from tests.conftest import REDIS_URL, ProcessReaper
from tests.support.browser import chromium, wait_for
from tests.support.running_stack import RunningStack, running_stack
from tests.support.supervision import REPORT

pytestmark = pytest.mark.e2e

ROWS = """
return Array.from(document.querySelectorAll('#instances tbody tr')).map(tr => ({
  id: tr.dataset.instance,
  cells: Array.from(tr.cells).map(td => td.textContent.trim()),
}));
"""
SHARE, LOAD, HIT_RATE, TTFT_P50, SCRAPE = 3, 4, 5, 6, 11
TABLE = """
return Array.from(document.querySelectorAll('#ID tbody tr'))
  .map(tr => Array.from(tr.cells).map(td => td.textContent.trim()));
"""


def rows(driver: Any) -> dict[str, list[str]]:
    return {r["id"]: r["cells"] for r in driver.execute_script(ROWS)}


def text(driver: Any, element_id: str) -> str:
    return str(driver.execute_script(f"return document.getElementById('{element_id}').textContent"))


def visible(driver: Any, element_id: str) -> bool:
    return not driver.execute_script(f"return document.getElementById('{element_id}').hidden")


def percent(cell: str) -> float:
    return float(cell.rstrip("%"))


def warm_up(stack: RunningStack) -> None:
    """Requests that share prefixes, so every instance reports hits and TTFT.

    Through the router first; then the same prompt twice straight to each instance, since
    where the router places a dozen topics on three instances is its business (one may
    get none) and the page must show every instance's figures."""
    with httpx.Client(timeout=30) as client:
        for topic in range(12):
            for turn in range(2):
                r = stack.chat(client, f"Topic {topic}. " + "Background text. " * 60 + str(turn))
                assert r.status_code == 200, r.text
        for instance in stack.instance_ids:
            body = {
                "model": "meta-llama/Llama-3.1-70B-Instruct",
                "messages": [{"role": "user", "content": "Direct. " * 200}],
                "max_tokens": 4,
            }
            for _ in range(2):
                r = client.post(f"http://{instance}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text


def test_status_page_shows_the_fleet_and_follows_changes(
    procs: ProcessReaper, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    with running_stack(procs, tmp_path, instances=3) as stack, chromium(tmp_path / "p") as driver:
        warm_up(stack)
        ids = stack.instance_ids
        driver.get(f"{stack.admin_url}/ui")

        # no data without the token; a wrong one is refused
        wait_for(lambda: visible(driver, "login"), 30, "the page asks for the token")
        assert not visible(driver, "main") and rows(driver) == {}
        driver.find_element(By.ID, "token").send_keys("not-the-token")
        driver.find_element(By.ID, "login-submit").click()
        wait_for(lambda: "refused" in text(driver, "login-reason"), 30, "a wrong token is refused")
        driver.find_element(By.ID, "token").send_keys(stack.stack.token)
        driver.find_element(By.ID, "login-submit").click()

        # every instance, with its share of the key space and its load; no threshold by default
        wait_for(lambda: sorted(rows(driver)) == sorted(ids), 30, "every instance is listed")
        assert text(driver, "threshold") == "off" and text(driver, "config-version") == "1"
        shown = rows(driver)
        assert sum(percent(shown[i][SHARE]) for i in ids) == pytest.approx(100, abs=0.2)
        assert all(percent(shown[i][SHARE]) > 5 for i in ids)
        # in flight / the in-flight bound: load_factor x the fleet's mean + the slack when idle
        assert all(shown[i][LOAD] == f"0 / {IN_FLIGHT_SLACK}" for i in ids)
        # vLLM's own figures arrive with the next scrape rounds (every 2 s)
        wait_for(
            lambda: (
                all(rows(driver)[i][SCRAPE] == "ok" for i in ids)
                and any(percent(rows(driver)[i][HIT_RATE]) > 0 for i in ids)
                and all(rows(driver)[i][TTFT_P50].endswith(" ms") for i in ids)
            ),
            15,
            "hit rate and TTFT are shown",
        )

        # the token survives a reload (sessionStorage): no second prompt
        driver.refresh()
        wait_for(lambda: sorted(rows(driver)) == sorted(ids), 30, "the page comes back")
        assert not visible(driver, "login")

        with stack.admin() as admin:
            r = admin.patch("/config", json={"concurrency_threshold": 5})
            assert r.status_code == 200, r.text
            wait_for(
                lambda: (
                    text(driver, "threshold") == "5"
                    and text(driver, "config-version") == "2"
                    and all(rows(driver)[i][LOAD] == f"0 / {IN_FLIGHT_SLACK}" for i in ids)
                ),
                30,
                "the page shows the new threshold",
            )
            assert '"concurrency_threshold": 5' in text(driver, "config")

            spare = stack.start_spare_sim()
            host, port = spare.rsplit(":", 1)
            before = rows(driver)  # before the page can show the change
            r = admin.post("/instances", json={"address": host, "port": int(port)})
            assert r.status_code == 201, r.text
        wait_for(
            lambda: (
                sorted(rows(driver)) == sorted([*ids, spare])
                and percent(rows(driver)[spare][SHARE]) > 5
            ),
            30,
            "the new instance is listed with its share of the ring",
        )
        after = rows(driver)
        assert text(driver, "fleet-version") == "2"
        assert sum(percent(after[i][SHARE]) for i in after) == pytest.approx(100, abs=0.2)
        # it took its share from the others
        assert all(percent(after[i][SHARE]) < percent(before[i][SHARE]) for i in ids)
        wait_for(lambda: rows(driver)[spare][SCRAPE] == "ok", 30, "the new instance is scraped")

        # under prefix-router up, its supervisor's report adds the process table
        assert not visible(driver, "processes")  # this stack runs without up's supervisor
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            write_report(client, stack.settings.namespace, REPORT)
        finally:
            client.close()
        wait_for(lambda: visible(driver, "processes"), 30, "the process table is shown")
        processes = {r[0]: r for r in driver.execute_script(TABLE.replace("ID", "components"))}
        assert processes["envoy"][1:4] == ["12", "starting", "2"]
        assert processes["envoy"][4].startswith("killed by SIGSEGV (core dumped) at ")
        assert processes["redis"][1:5] == ["11", "running", "0", "–"]
        [exit_row] = driver.execute_script(TABLE.replace("ID", "supervision-events"))
        assert exit_row[1:3] == [
            "envoy",
            "killed by SIGSEGV (core dumped) after 61 s; restart in 0.5 s",
        ]
        # the log is text, never markup
        assert driver.execute_script("return document.querySelector('#processes script')") is None
        assert "<script>alert(1)</script>" in text(driver, "supervision-events")
        # pools by model: hidden while the fleet declares none, shown once one instance does
        assert not visible(driver, "pools-section")
        with stack.admin() as admin:
            r = admin.patch(f"/instances/{ids[0]}", json={"models": ["base-a"]})
            assert r.status_code == 200, r.text
        wait_for(lambda: visible(driver, "pools-section"), 30, "the pools are shown")
        pools = {r[0]: r[1] for r in driver.execute_script(TABLE.replace("ID", "pools"))}
        others = sorted({*ids, spare} - {ids[0]})
        assert pools == {
            "base-a": ", ".join(sorted([*ids, spare])),  # undeclared instances serve anything
            "any other model": ", ".join(others),
        }

        # no script error on the way: the only console entries are the refused requests
        errors = [e["message"] for e in driver.get_log("browser") if "401" not in e["message"]]
        assert errors == []
