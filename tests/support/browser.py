"""Headless Debian Chromium driven by selenium through /usr/bin/chromedriver; nothing downloads a
browser. ``./dev test`` installs the ``chromium`` and ``chromium-driver`` packages when missing.

chromedriver runs in a session of its own and dies with the test process (``PR_SET_PDEATHSIG``,
tests/support/daemons.py); chromium, its child, is started through a wrapper that asks for the same
signal when chromedriver dies (a ``kill -9`` of chromedriver leaves chromium running otherwise; the
browser process takes its renderers, zygote and crash handlers with it). Every WebDriver command has a deadline, and the
teardown kills the whole tree by process group after a bounded ``quit``: a renderer that spins
fails the test instead of hanging the suite. (In CI two renderers once held both cores for 40
minutes: they had inherited SCHED_FIFO 99 from the test process, which an SVT-AV1 encoder had left
real-time; see ``pid_platform.demo.sample_video.scheduling_kept`` and tests/support/scheduling.py.)
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.daemons import free_port, spawn, wait_until
from tests.support.process_tree import kill_process_tree, wait_until_gone

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1600,1000",
         # A runaway page crashes its tab at 1 GiB of JS heap instead of taking the machine's memory.
         "--js-flags=--max-old-space-size=1024")
COMMAND_TIMEOUT_S = 120  # one WebDriver command (a page load, page_source); selenium's default has none that short
QUIT_TIMEOUT_S = 20
_DIES_WITH_PARENT = """#!{python}
import ctypes, os, signal, sys
parent = os.getppid()
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG; it survives the exec below
if os.getppid() != parent:  # the parent died before the signal was armed
    os.kill(os.getpid(), signal.SIGKILL)
os.execv({binary!r}, [{binary!r}, *sys.argv[1:]])
"""


def chromium_dying_with_parent(folder: Path) -> Path:
    """An executable that runs Debian's chromium with ``PR_SET_PDEATHSIG`` set to SIGKILL."""
    wrapper = folder / "chromium-dies-with-parent"
    wrapper.write_text(_DIES_WITH_PARENT.format(python=sys.executable, binary=str(CHROMIUM)))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper


@contextmanager
def headless_chromium(user_data_dir: Path, log: Path) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.remote.client_config import ClientConfig

    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium_dying_with_parent(log.parent))
    for flag in (*FLAGS, f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    driver_proc = spawn([str(CHROMEDRIVER), f"--port={port}", f"--log-path={log}"], cwd=log.parent,
                        env=os.environ, log=log.with_suffix(".out"))
    try:
        wait_until(lambda: urllib.request.urlopen(f"{url}/status", timeout=2).status == 200,
                   driver_proc, "chromedriver", log.with_suffix(".out"), 30)
        driver = webdriver.Remote(command_executor=url, options=options,
                                  client_config=ClientConfig(url, timeout=COMMAND_TIMEOUT_S))
        driver.set_page_load_timeout(COMMAND_TIMEOUT_S)
        try:
            yield driver
        finally:
            quitter = threading.Thread(target=driver.quit, name="chromium-quit", daemon=True)
            quitter.start()
            quitter.join(QUIT_TIMEOUT_S)
    finally:
        groups = kill_process_tree(driver_proc.pid)  # chromium and its renderers, whatever quit did
        driver_proc.wait()
        left = wait_until_gone(groups, 10)
        assert not left, f"chromium processes survived their teardown: {left}"


def wait_for_text(driver, texts: list[str], timeout_s: float = 30) -> list[str]:
    """Wait until every one of ``texts`` is in the page's HTML; the ones still missing at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        source = driver.page_source
        missing = [t for t in texts if t not in source]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)
