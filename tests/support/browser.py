"""A real headless Chromium for page tests: Debian's ``chromium`` driven by Selenium through
Debian's ``chromedriver`` (no browser or driver is downloaded at run time).

Needs: ``apt-get install -y chromium chromium-driver`` and ``pip install selenium``. When any
is missing the test FAILS with that message: a page test that silently skips tests nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def _require(path: str, what: str) -> str:
    found = shutil.which(path) or (path if os.access(path, os.X_OK) else None)
    if found is None:
        pytest.fail(f"{what} not found at {path}: the status page test needs it ({INSTALL})")
    return found


@contextlib.contextmanager
def chromium(profile_dir: Path) -> Iterator[Any]:
    """A Selenium WebDriver on a fresh headless Chromium profile; quits on exit."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed: the status page test needs it ({INSTALL})")
    options = webdriver.ChromeOptions()
    options.binary_location = _require(CHROMIUM, "Chromium")
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    service = Service(executable_path=_require(CHROMEDRIVER, "chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check()`` (page reads may race a re-render) until truthy; fail after ``timeout``."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def attempt(_: Any) -> Any:
        try:
            return check()
        except (WebDriverException, AssertionError, ValueError, IndexError, KeyError):
            return False

    try:
        return WebDriverWait(None, timeout, poll_frequency=0.1).until(attempt)
    except Exception as exc:  # selenium's TimeoutException
        raise AssertionError(f"timed out after {timeout}s waiting until {what}") from exc
