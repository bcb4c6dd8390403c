"""The shaping proxy bench_remote_read puts in front of the S3 server (a child process):
a first-byte delay per response and a byte-rate cap per connection, loopback only.

A thread per direction of each connection, and the response bytes moved socket to pipe to
socket with ``os.splice`` (they never enter Python; Linux only, as the bench's ``/proc``
readings are). The proxy it replaces was one asyncio loop forwarding 64 KiB reads: its pacing
sleeps were rounded up to whole milliseconds (epoll's timeout), so one connection carried 25-30
MB/s under a 50 MB/s cap on an idle machine, and it spent about 0.5 CPU-s of the bench's two
cores per 700 MB forwarded."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import threading
import time

CHUNK = 256 << 10  # bytes forwarded per paced step: 5 ms at 50 MB/s


def child_proxy(args) -> None:
    """Forward 127.0.0.1:<port> to the S3 server: the first byte of each response waits
    ``delay`` after its request; each connection carries at most ``cap`` bytes/s. Prints its
    port, then the bytes forwarded to clients whenever a line arrives on stdin; ends when
    stdin closes."""
    host, port = args.upstream.rsplit(":", 1)
    shaping = _Shaping(args.delay_ms / 1000, args.cap_mbps * 1e6)
    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    print(listener.getsockname()[1], flush=True)
    threading.Thread(target=_answer_counts, args=(shaping,), daemon=True).start()
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve, args=(client, (host, int(port)), shaping), daemon=True).start()


class _Shaping:
    def __init__(self, delay: float, cap: float):
        self.delay, self.cap = delay, cap
        self._lock = threading.Lock()
        self._forwarded = 0

    def count(self, n: int) -> None:
        with self._lock:
            self._forwarded += n

    def forwarded(self) -> int:
        with self._lock:
            return self._forwarded


def _answer_counts(shaping: _Shaping) -> None:
    while sys.stdin.readline():
        print(shaping.forwarded(), flush=True)
    os._exit(0)  # the bench ended (stdin closed): so does the proxy


class _Request:
    """When the request whose response has not begun was sent (None: none waiting)."""

    __slots__ = ("asked",)

    def __init__(self):
        self.asked: float | None = None


def _serve(client: socket.socket, upstream: tuple[str, int], shaping: _Shaping) -> None:
    try:
        server = socket.create_connection(upstream)
    except OSError:
        client.close()
        return
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = _Request()
    up = threading.Thread(target=_forward_requests, args=(client, server, request), daemon=True)
    up.start()
    try:
        _forward_responses(server, client, request, shaping)
    except OSError:
        pass
    finally:
        for s in (client, server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        up.join()
        client.close()
        server.close()


def _forward_requests(client: socket.socket, server: socket.socket, request: _Request) -> None:
    try:
        while data := client.recv(1 << 16):
            if request.asked is None:
                request.asked = time.monotonic()
            server.sendall(data)
        server.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _forward_responses(server: socket.socket, client: socket.socket, request: _Request,
                       shaping: _Shaping) -> None:
    """Server to client, paced: each chunk leaves when the cap allows; the first of a response
    not before ``delay`` after its request."""
    move = _Splice(server, client)
    free_at = 0.0
    try:
        while n := move.take(CHUNK):
            now = time.monotonic()
            asked, request.asked = request.asked, None
            if asked is not None:
                if asked + shaping.delay > now:
                    time.sleep(asked + shaping.delay - now)
                    now = time.monotonic()
                free_at = max(free_at, now)
            if free_at > now:
                time.sleep(free_at - now)
            free_at = max(free_at, time.monotonic()) + n / shaping.cap
            move.give(n)
            shaping.count(n)
    finally:
        move.close()


class _Splice:
    """Bytes from one socket to another through a pipe, in the kernel."""

    def __init__(self, src: socket.socket, dst: socket.socket):
        self.src, self.dst = src.fileno(), dst.fileno()
        self.r, self.w = os.pipe()
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: the default pipe's size
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, CHUNK)

    def take(self, n: int) -> int:
        return os.splice(self.src, self.w, n)

    def give(self, n: int) -> None:
        while n:
            n -= os.splice(self.r, self.dst, n)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class Proxy:
    def __init__(self, script: str, upstream: str, delay_ms: int, cap_mbps: float):
        """``script``: the bench's file, whose ``--child proxy`` runs ``child_proxy``."""
        from pid_platform.demo.local_s3 import _die_with_parent

        self.proc = subprocess.Popen(
            [sys.executable, script, "--child", "proxy", "--upstream", upstream.split("//", 1)[1],
             "--delay-ms", str(delay_ms), "--cap-mbps", str(cap_mbps)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def forwarded(self) -> int:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
