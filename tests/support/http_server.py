"""A real, threaded, range-capable HTTP/1.1 file server on 127.0.0.1 (stdlib ``http.server``).

Serves a directory with ``Range: bytes=a-b | a- | -n`` (206 + Content-Range, 416), HEAD,
strong ETags (content hash) and If-Match (412). Knobs for tests: ``forbidden`` paths answer 403,
``ignore_range`` answers every GET with 200 and the whole file, ``require_bearer`` answers 401
without ``Authorization: Bearer <token>``, ``delay_s`` waits that long before answering each GET
(so concurrent requests really overlap), setting ``fail_gets = n`` answers the next ``n``
GETs with 503, and ``empty_ranges = n`` the next ``n`` ranged GETs with a 206 holding no bytes
(Content-Length 0, no Content-Range: what a broken cache in front of a server may send). Every
request is recorded in ``requests``; ``max_in_flight`` is the most GETs that were being answered
at once (``reset_in_flight()`` starts a new measurement).

Fixture ``http_server(root, **options) -> RangeHTTPServer``; servers stop at teardown.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import pytest

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_CHUNK = 16 * 1024  # small writes, so a proxy sees the body arrive in pieces


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    status: int
    headers: dict[str, str] = field(repr=False)


class RangeHTTPServer:
    def __init__(self, root: str | Path, *, forbidden: set[str] | tuple[str, ...] = (),
                 ignore_range: bool = False, require_bearer: str | None = None, delay_s: float = 0.0):
        self.root = Path(root).resolve()
        self.forbidden = {p.lstrip("/") for p in forbidden}   # paths relative to root
        self.ignore_range = ignore_range
        self.require_bearer = require_bearer
        self.delay_s = delay_s
        self.fail_gets = 0
        self.empty_ranges = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="range-http-server", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, relpath: str) -> str:
        return f"{self.url}/{quote(relpath.lstrip('/'))}"

    def gets(self, path: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and (path is None or r.path == path)]

    def reset_in_flight(self) -> None:
        with self._lock:
            self.max_in_flight = self.in_flight

    def _enter_get(self) -> bool:
        """Count a GET in flight; True when it must fail with 503 (``fail_gets``)."""
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            fail = self.fail_gets > 0
            self.fail_gets -= fail
            return fail

    def _take_empty_range(self) -> bool:
        with self._lock:
            empty = self.empty_ranges > 0
            self.empty_ranges -= empty
            return empty

    def _leave_get(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def start(self) -> RangeHTTPServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:  # idle keep-alive handlers would otherwise wait for their timeout
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def __enter__(self) -> RangeHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_owner: RangeHTTPServer
    timeout = 10  # an idle keep-alive connection ends by itself

    def setup(self) -> None:
        super().setup()
        with self.server_owner._lock:
            self.server_owner._conns.add(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.server_owner._lock:
            self.server_owner._conns.discard(self.connection)

    def log_message(self, format: str, *args: object) -> None:  # quiet under pytest
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        owner = self.server_owner
        fail = owner._enter_get()
        try:
            if owner.delay_s:
                time.sleep(owner.delay_s)
            self._serve(body=True, unavailable=fail)
        finally:
            owner._leave_get()

    def _serve(self, body: bool, unavailable: bool = False) -> None:
        owner = self.server_owner
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        rng = self.headers.get("Range")

        def reply(status: int, headers: dict[str, str], payload: bytes = b"") -> None:
            owner._record(Request(self.command, rel, rng, status, dict(self.headers.items())))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body and payload:
                try:
                    for i in range(0, len(payload), _CHUNK):
                        self.wfile.write(payload[i:i + _CHUNK])
                        self.wfile.flush()
                except OSError:  # the client (or a fault proxy) hung up mid-body
                    self.close_connection = True

        if unavailable:
            return reply(503, {"Retry-After": "0"})
        if owner.require_bearer and self.headers.get("Authorization") != f"Bearer {owner.require_bearer}":
            return reply(401, {})
        if rel in owner.forbidden:
            return reply(403, {})
        path = (owner.root / rel).resolve()
        if not path.is_relative_to(owner.root) or not path.is_file():
            return reply(404, {})
        data = path.read_bytes()
        # Hash the content (not mtime): a rewrite within one clock tick must still change it.
        etag = '"' + hashlib.sha1(data).hexdigest() + '"'
        base = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if_match = self.headers.get("If-Match")
        if if_match and if_match.strip() not in ("*", etag):
            return reply(412, base)
        span = None if owner.ignore_range else _parse_range(rng, len(data))
        if span == "unsatisfiable":
            return reply(416, {**base, "Content-Range": f"bytes */{len(data)}"})
        if span is None:
            return reply(200, base, data)
        if body and owner._take_empty_range():
            return reply(206, base)
        a, b = span
        return reply(206, {**base, "Content-Range": f"bytes {a}-{b - 1}/{len(data)}"}, data[a:b])


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """One ``bytes=`` range -> [a, b); None to serve the whole file (absent or multi-range)."""
    m = _RANGE.fullmatch((header or "").strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # suffix: the last n bytes
        n = int(m.group(2))
        return (max(0, size - n), size) if n else "unsatisfiable"
    a = int(m.group(1))
    b = min(size, int(m.group(2)) + 1) if m.group(2) else size
    if a >= size or b <= a:
        return "unsatisfiable"
    return a, b


@pytest.fixture
def http_server() -> Iterator:
    """Factory: ``http_server(root, forbidden=..., ignore_range=..., require_bearer=..., delay_s=...)``."""
    servers: list[RangeHTTPServer] = []

    def start(root: str | Path, **options: object) -> RangeHTTPServer:
        server = RangeHTTPServer(root, **options).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
