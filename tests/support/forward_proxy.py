"""A real HTTP forward proxy on 127.0.0.1 (stdlib ``http.server`` + ``http.client``): what
``HTTP_PROXY`` names. It forwards each absolute-URI request (``GET http://host/path``) to its
host, relays the answer, and records ``(method, url)`` in ``requests``. Plain HTTP only (no
``CONNECT``): the tests' servers speak HTTP.

Fixture ``forward_proxy() -> ForwardProxy``; proxies stop at teardown.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade"}


class ForwardProxy:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _forward(self) -> None:
                owner.requests.append((self.command, self.path))
                target = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                upstream = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=30)
                try:
                    path = target.path + (f"?{target.query}" if target.query else "")
                    upstream.request(self.command, path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> ForwardProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def forward_proxy() -> Iterator:
    """Factory: ``forward_proxy() -> ForwardProxy`` (started)."""
    proxies: list[ForwardProxy] = []

    def start() -> ForwardProxy:
        proxy = ForwardProxy().start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()
