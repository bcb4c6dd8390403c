"""bench_remote_read's shaping proxy models a cloud bucket: each response's first byte waits the
delay after its request, and one connection carries its cap, neither more nor much less. The
proxy before this one carried 25-30 MB/s under a 50 MB/s cap (its pacing sleeps were rounded up
to whole milliseconds), so every "at the cap" figure the bench printed was at about half of it."""

from __future__ import annotations

import http.client
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "bench_remote_read.py"
sys.path.insert(0, str(ROOT / "bench"))

from remote_read.proxy import CHUNK, Proxy  # noqa: E402

DELAY_S, CAP_MBPS = 0.06, 50


def _get(conn: http.client.HTTPConnection, path: str, first: int, last: int) -> tuple[bytes, float, float]:
    """(body, seconds to its first byte, seconds to its end) of one ranged GET on ``conn``."""
    t0 = time.monotonic()
    conn.request("GET", path, headers={"Range": f"bytes={first}-{last}"})
    resp = conn.getresponse()
    assert resp.status == 206, resp.status
    head = resp.read(1)
    t_first = time.monotonic() - t0
    body = head + resp.read()
    return body, t_first, time.monotonic() - t0


def test_each_response_waits_its_delay_and_a_connection_carries_its_cap(http_server, tmp_path) -> None:
    blob = os.urandom(8 << 20)
    (tmp_path / "blob").write_bytes(blob)
    server = http_server(tmp_path)
    proxy = Proxy(str(SCRIPT), server.url, int(DELAY_S * 1000), CAP_MBPS)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=30)
        # Two requests on one kept-alive connection: the second waits its own delay too.
        took = {}
        for first, last in [(0, len(blob) - 1), (1000, 1000 + (2 << 20) - 1)]:
            body, t_first, elapsed = _get(conn, "/blob", first, last)
            assert body == blob[first:last + 1]
            assert t_first >= DELAY_S, f"first byte after {t_first * 1000:.1f} ms, before the {DELAY_S * 1000:.0f} ms delay"
            # Never faster than the cap: only the first chunk leaves without waiting its turn.
            fastest = DELAY_S + max(0, len(body) - CHUNK) / (CAP_MBPS * 1e6)
            assert elapsed >= fastest, f"{len(body)} bytes in {elapsed:.3f} s: faster than {CAP_MBPS} MB/s"
            took[len(body)] = elapsed - DELAY_S
        conn.close()
        # Not far under the cap either, on the whole blob (the old proxy: 0.56 of it).
        rate = len(blob) / took[len(blob)] / 1e6
        assert rate >= 0.7 * CAP_MBPS, (
            f"one connection carried {rate:.1f} MB/s through a proxy capped at {CAP_MBPS} MB/s "
            f"({len(blob)} bytes in {took[len(blob)]:.3f} s after the first-byte delay)")
        forwarded = proxy.forwarded()
        bodies = len(blob) + (2 << 20)
        assert bodies <= forwarded < bodies + 3 * 4096  # the bodies and their response headers
    finally:
        proxy.stop()

