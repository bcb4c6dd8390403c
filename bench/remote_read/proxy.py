"""The shaping proxy bench_remote_read puts in front of the S3 server (a child process):
a first-byte delay per response and a byte-rate cap per connection, loopback only."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys


def child_proxy(args) -> None:
    """Forward 127.0.0.1:<port> to the S3 server: the first byte of each response waits
    ``delay`` after its request; each connection carries at most ``cap`` bytes/s. Prints its
    port, then the bytes forwarded to clients whenever a line arrives on stdin."""
    host, port = args.upstream.rsplit(":", 1)
    delay, cap = args.delay_ms / 1000, args.cap_mbps * 1e6
    forwarded = [0]

    async def pipe_up(reader, writer, state) -> None:
        while data := await reader.read(1 << 16):
            if not state["pending"]:
                state["pending"], state["asked"] = True, asyncio.get_running_loop().time()
            writer.write(data)
            await writer.drain()
        writer.close()

    async def pipe_down(reader, writer, state) -> None:
        loop = asyncio.get_running_loop()
        free_at = 0.0
        while data := await reader.read(1 << 16):
            now = loop.time()
            if state["pending"]:
                state["pending"] = False
                if state["asked"] + delay > now:
                    await asyncio.sleep(state["asked"] + delay - now)
                    now = loop.time()
                free_at = max(free_at, now)
            if free_at > now:
                await asyncio.sleep(free_at - now)
            free_at = max(free_at, loop.time()) + len(data) / cap
            forwarded[0] += len(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    async def handle(creader, cwriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection(host, int(port))
        except OSError:
            cwriter.close()
            return
        state = {"pending": False, "asked": 0.0}
        with _quiet():
            await asyncio.gather(pipe_up(creader, swriter, state), pipe_down(sreader, cwriter, state))

    async def control() -> None:
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(forwarded[0], flush=True)
        os._exit(0)  # the bench ended (stdin closed): so does the proxy

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await control()

    asyncio.run(main())


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is not None and issubclass(kind, (ConnectionError, OSError, asyncio.CancelledError))


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
