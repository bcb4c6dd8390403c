"""Headless Debian Chromium driven by selenium through /usr/bin/chromedriver; nothing downloads a
browser. ``./dev test`` installs the ``chromium`` and ``chromium-driver`` packages when missing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1600,1000")


@contextmanager
def headless_chromium(user_data_dir: Path, log: Path) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER), log_output=str(log)), options=options)
    try:
        yield driver
    finally:
        driver.quit()  # ends chromium and chromedriver


def wait_for_text(driver, texts: list[str], timeout_s: float = 30) -> list[str]:
    """Wait until every one of ``texts`` is in the page's HTML; the ones still missing at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        source = driver.page_source
        missing = [t for t in texts if t not in source]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)
