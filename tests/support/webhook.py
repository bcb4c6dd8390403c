"""A stdlib HTTP server on 127.0.0.1 that records every POST it gets (an alert webhook's stand-in).

    with WebhookRecorder() as hook:
        ...  # something POSTs to hook.url
        assert hook.posts[0]["body"]["job"] == "source_build"
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookRecorder:
    def __init__(self, status: int = 200) -> None:
        self.posts: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                recorder.posts.append({"path": self.path, "content_type": self.headers.get("Content-Type"),
                                       "body": json.loads(raw)})
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # quiet under pytest
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/alerts"

    def __enter__(self) -> WebhookRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
