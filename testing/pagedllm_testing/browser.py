"""Headless Chromium for the tests that open the node's pages: Debian's ``chromium`` driven by
Selenium through ``chromium-driver`` (the system's browser and driver, nothing downloaded)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)
INSTALL_HINT = "apt-get install -y chromium chromium-driver (CI installs them: .ci/run)"


def find(names: tuple[str, ...]) -> str | None:
    for name in names:
        path = shutil.which(name) or (
            f"/usr/lib/chromium/{name}" if os.path.exists(f"/usr/lib/chromium/{name}") else None
        )
        if path:
            return path
    return None


def browser_or_skip() -> tuple[str, str]:
    """(browser, driver); skips when the machine has none, fails on CI where it must."""
    browser, driver = find(BROWSERS), find(DRIVERS)
    if browser and driver:
        return browser, driver
    missing = "no Chromium browser" if browser is None else "no chromedriver"
    if os.environ.get("CI"):
        pytest.fail(f"{missing} found on CI: {INSTALL_HINT}")
    pytest.skip(f"{missing} found: {INSTALL_HINT}")


@contextmanager
def chromium(width: int = 1100, height: int = 640) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = browser_or_skip()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
