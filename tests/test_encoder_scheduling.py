"""SVT-AV1, run as root, leaves the thread that opened an encoder under SCHED_FIFO priority 99;
``encode_mp4`` gives the thread its scheduling back, and the suite fails a test that leaves the
test process real-time (tests/support/scheduling.py). Each encode runs in a child process of
its own, so this test process is never raised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="POSIX scheduling calls")
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

ENCODE = textwrap.dedent("""
    import contextlib, json, os, sys
    sys.path.insert(0, {repo!r})
    import numpy as np
    from pathlib import Path
    from tests.support import video
    frames = [np.full((48, 64, 3), 40 * i, np.uint8) for i in range(4)]
    before = os.sched_getscheduler(0)
    if {kept}:
        video.encode_mp4(Path({out!r}), frames, fps=10, codec="libsvtav1")
    else:
        video.scheduling_kept = contextlib.nullcontext   # the same encode without the guard
        video.encode_plain_mp4(Path({out!r}), frames, codec="libsvtav1")
    print(json.dumps({{"before": before, "after": os.sched_getscheduler(0)}}))
""")


def _encode_in_child(tmp_path: Path, kept: bool) -> dict:
    code = ENCODE.format(repo=str(REPO), out=str(tmp_path / f"kept-{kept}.mp4"), kept=kept)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SVT_LOG": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_encode_mp4_gives_the_thread_its_scheduling_back(tmp_path: Path) -> None:
    got = _encode_in_child(tmp_path, kept=True)
    assert got["after"] == got["before"] == os.SCHED_OTHER


@pytest.mark.skipif(not AS_ROOT, reason="SVT-AV1 raises the policy only where it may: as root")
def test_a_bare_svt_av1_encoder_leaves_the_thread_real_time(tmp_path: Path) -> None:
    # Why scheduling_kept exists: the same encode without it.
    got = _encode_in_child(tmp_path, kept=False)
    assert got["before"] == os.SCHED_OTHER and got["after"] == os.SCHED_FIFO


@pytest.mark.skipif(not AS_ROOT, reason="only root may set a real-time policy")
def test_the_suite_fails_a_test_that_leaves_the_process_real_time(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["tests.support.scheduling"]')
    pytester.makepyfile("""
        import os

        def test_raises_itself():
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))

        def test_after_it():
            assert os.sched_getscheduler(0) == os.SCHED_OTHER
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", f"pythonpath={REPO}")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*left this process's thread under real-time scheduling*scheduling_kept*"])
