"""A byte-transparent TCP proxy on 127.0.0.1 that injects faults into server->client traffic.

It sits in front of any server (the range HTTP server, SeaweedFS S3). Because it never touches
the bytes, the Host header a client signs (SigV4) is the one the server sees, so signatures stay
valid. Each accepted connection takes the next ``Fault`` from the plan (``PASS`` once the plan is
used up); a fault fires once the connection has carried ``after`` response bytes:

* ``rst``: abort the client connection (TCP RST);      * ``fin``: close it cleanly (TCP FIN);
* ``stall``: forward nothing for ``seconds``, then go on; * ``trickle``: forward at ``bps`` from then on;
* ``unavailable``: answer the connection's first request with an S3-style HTTP 503 (SlowDown's
  cousin, ServiceUnavailable) and close it, never reaching the server;
* ``cut_request``: watch client->server bytes and reset the connection (TCP RST, the server
  gets nothing more) when a request matching ``request`` (a regex over the raw bytes, e.g. the
  request line of one upload) starts: a connection dropped during that request, whatever others
  the connection carried before.

Every wait is bounded and interruptible; ``stop()`` (fixture teardown) ends all connections.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import pytest

_POLL_S = 0.05
_RECV = 64 * 1024


@dataclass(frozen=True)
class Fault:
    action: Literal["pass", "rst", "fin", "stall", "trickle", "unavailable", "cut_request"] = "pass"
    after: int = 0            # response bytes forwarded on this connection before the fault
    seconds: float = 0.0      # stall length
    bps: float = 0.0          # trickle rate, bytes per second
    chunk: int = 256          # trickle piece size
    request: bytes = b""      # cut_request: regex over client->server bytes


PASS = Fault()


def drop(after: int, *, rst: bool = True) -> Fault:
    return Fault("rst" if rst else "fin", after)


def stall(after: int, seconds: float) -> Fault:
    return Fault("stall", after, seconds=seconds)


def trickle(after: int, bps: float, chunk: int = 256) -> Fault:
    return Fault("trickle", after, bps=bps, chunk=chunk)


def unavailable() -> Fault:
    """The connection's first request answered 503 Service Unavailable, as S3 does under load."""
    return Fault("unavailable")


def cut_request(request: bytes) -> Fault:
    """The connection reset as a request matching ``request`` (a bytes regex) starts."""
    return Fault("cut_request", request=request)


# How far back a cut_request pattern may reach into the previous chunk (a request line split
# between two reads still matches).
_CUT_LOOKBACK = 512

_503_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(_503_BODY)).encode() + b"\r\n\r\n" + _503_BODY)


class FaultProxy:
    def __init__(self, upstream: str | tuple[str, int], plan: Iterable[Fault] = ()):
        if isinstance(upstream, str):
            parts = urlsplit(upstream)
            upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.upstream = upstream
        self._plan: deque[Fault] = deque(plan)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.connections = 0
        self.fired: Counter[str] = Counter()   # faults that actually fired, by action
        self.bytes_down = 0                    # server -> client bytes forwarded
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_plan(self, plan: Iterable[Fault]) -> None:
        """Replace what the next connections get (connections already open keep theirs)."""
        with self._lock:
            self._plan = deque(plan)

    @property
    def plan_left(self) -> int:
        with self._lock:
            return len(self._plan)

    def start(self) -> FaultProxy:
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._accept_thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            socks, threads = list(self._sockets), list(self._threads)
        for s in socks:
            _close(s)
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- plumbing -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                fault = self._plan.popleft() if self._plan else PASS
                self.connections += 1
            if fault.action == "unavailable":
                t = threading.Thread(target=self._refuse, args=(client,), daemon=True)
                with self._lock:
                    self._sockets.add(client)
                    self._threads.append(t)
                t.start()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, server))
            for s in (client, server):
                s.settimeout(_POLL_S)
            done = _Countdown(2, lambda c=client, s=server: self._forget(c, s))
            for target, args in ((self._pump_up, (client, server, fault, done)),
                                 (self._pump_down, (server, client, fault, done))):
                t = threading.Thread(target=target, args=args, daemon=True)
                with self._lock:
                    self._threads.append(t)
                t.start()

    def _refuse(self, client: socket.socket) -> None:
        """Read one request's headers (a GET has no body), answer 503, close."""
        client.settimeout(_POLL_S)
        got = b""
        try:
            while b"\r\n\r\n" not in got:
                data = self._recv(client)
                if not data:
                    return
                got += data
            if self._send(client, _503):
                with self._lock:
                    self.fired["unavailable"] += 1
        finally:
            _close(client)
            with self._lock:
                self._sockets.discard(client)

    def _recv(self, s: socket.socket) -> bytes | None:
        """Next bytes, b"" at EOF, None when stopping or the socket is gone."""
        while not self._stop.is_set():
            try:
                return s.recv(_RECV)
            except TimeoutError:
                continue
            except OSError:
                return None
        return None

    def _forget(self, client: socket.socket, server: socket.socket) -> None:
        _close(client)
        _close(server)
        with self._lock:
            self._sockets.difference_update((client, server))

    def _pump_up(self, client: socket.socket, server: socket.socket, fault: Fault, done: _Countdown) -> None:
        cut = re.compile(fault.request) if fault.action == "cut_request" else None
        tail = b""
        try:
            while (data := self._recv(client)):
                if cut is not None:
                    if cut.search(tail + data):  # checked before forwarding: the server never sees it
                        with self._lock:
                            self.fired["cut_request"] += 1
                        _close(client, rst=True)
                        _close(server)
                        return
                    tail = (tail + data)[-_CUT_LOOKBACK:]
                try:
                    server.sendall(data)
                except OSError:
                    break
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)
        finally:
            done.tick()

    def _send(self, client: socket.socket, data: bytes) -> bool:
        try:
            client.sendall(data)
        except OSError:
            return False
        with self._lock:
            self.bytes_down += len(data)
        return True

    def _pump_down(self, server: socket.socket, client: socket.socket, fault: Fault,
                   done: _Countdown) -> None:
        sent = 0
        armed = fault.action != "pass"
        trickling = False
        try:
            while (data := self._recv(server)):
                if armed and sent + len(data) > fault.after:
                    head, data = data[:fault.after - sent], data[fault.after - sent:]
                    if head and not self._send(client, head):
                        return
                    sent += len(head)
                    armed = False
                    with self._lock:
                        self.fired[fault.action] += 1
                    if fault.action in ("rst", "fin"):
                        _close(client, rst=fault.action == "rst")
                        return
                    if fault.action == "stall" and self._stop.wait(fault.seconds):
                        return
                    trickling = fault.action == "trickle"
                if trickling:
                    if not self._trickle(client, data, fault):
                        return
                elif not self._send(client, data):
                    return
                sent += len(data)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
        finally:
            # The client side stays open for _pump_up until the client hangs up, as it would
            # with the server itself; the last pump to finish closes both sockets.
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RD)
            done.tick()

    def _trickle(self, client: socket.socket, data: bytes, fault: Fault) -> bool:
        for i in range(0, len(data), fault.chunk):
            piece = data[i:i + fault.chunk]
            if not self._send(client, piece) or self._stop.wait(len(piece) / fault.bps):
                return False
        return True


class _Countdown:
    def __init__(self, n: int, then):
        self._n = n
        self._then = then
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._then()


def _close(s: socket.socket, *, rst: bool = False) -> None:
    with contextlib.suppress(OSError):
        if rst:  # linger 0: close() sends RST instead of FIN
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


@pytest.fixture
def fault_proxy() -> Iterator:
    """Factory: ``fault_proxy(upstream_url_or_host_port, plan=[...]) -> FaultProxy``."""
    proxies: list[FaultProxy] = []

    def start(upstream: str | tuple[str, int], plan: Iterable[Fault] = ()) -> FaultProxy:
        proxy = FaultProxy(upstream, plan).start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()
