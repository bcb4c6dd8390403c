"""tests/support/browser.py: the headless chromium the UI test drives dies with the test process,
even after ``kill -9`` of it (chromedriver by its own parent-death signal, chromium by the one its
wrapper arms), and a normal teardown leaves none of it running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.browser import CHROMEDRIVER, CHROMIUM
from tests.support.process_tree import descendants, process_table

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                                reason="Debian's chromium and chromium-driver are not installed")

HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.support.browser import headless_chromium
folder = Path({folder!r})
with headless_chromium(folder / "profile", folder / "chromedriver.log") as browser:
    browser.get("data:text/html,<p>ready</p>")
    assert "ready" in browser.page_source
    print("READY", flush=True)
    if {hold}:
        time.sleep(600)
"""


def _holder(folder: Path, hold: bool) -> subprocess.Popen:
    code = HOLDER.format(repo=str(REPO), folder=str(folder), hold=hold)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _browser_processes(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (chromedriver's log, chromium's profile)."""
    found = []
    for pid in process_table():
        try:
            if str(folder).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p, (_, _, state) in process_table().items() if p in pids and state not in "ZX"]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_kill_9_of_the_test_process_takes_chromedriver_and_chromium_with_it(tmp_path: Path) -> None:
    holder = _holder(tmp_path, hold=True)
    try:
        assert holder.stdout.readline().strip() == "READY"
        tree = descendants(holder.pid)
        started = sorted(set(tree) | set(_browser_processes(tmp_path)))
        assert len(started) >= 3, started  # chromedriver, the browser, at least one renderer
        holder.kill()
        holder.wait()
        assert _gone(started, 15) == []
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_normal_teardown_leaves_nothing_running(tmp_path: Path) -> None:
    holder = _holder(tmp_path, hold=False)
    out, _ = holder.communicate(timeout=120)
    assert holder.returncode == 0 and out.strip() == "READY"
    assert _gone(_browser_processes(tmp_path), 5) == []
