"""Run a function in N real processes that form a ``torch.distributed`` gloo process group.

    results = run_distributed(rank_fn, world_size=4, args=(data_root,), timeout=60)

``rank_fn(rank, world_size, *args)`` runs in every process after ``init_process_group``
(``gloo``, rendezvous through a ``file://`` store in a fresh temporary folder, so no port is
ever picked or raced for); what it returns (picklable) comes back as ``results[rank]``.

* A rank that raises fails the call with :class:`DistributedRunError`, which carries every
  rank's traceback.
* A rank still running at ``timeout`` is killed and the call fails with
  :class:`DistributedTimeout`: a hang fails the test instead of blocking CI. The process
  group's own timeout is set a little shorter, so a collective that waits on a dead peer
  raises in the rank first (with a traceback) whenever it can.

Processes come from a ``forkserver`` whose server has torch and the loader imported once per
test session: a fresh process then costs milliseconds instead of seconds of ``import torch``
(a plain ``spawn`` of 4 ranks takes ~15 s on a 2-core runner). Each rank is still a separate
process with its own interpreter state, and DataLoader workers inside a rank fork as usual
(the rank's start method is reset to ``fork``, as under torchrun on Linux).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

PRELOAD = (
    "numpy", "pyarrow", "pyarrow.parquet", "PIL.Image", "torch", "torch.distributed",
    "torch.utils.data", "webdataset", "loader.wds.pipeline", "pytest", "tests.support.dist",
)
KILL_GRACE_S = 5.0


class DistributedRunError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


class DistributedTimeout(DistributedRunError):
    """Some rank did not finish within the timeout (it was killed)."""


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    # Only takes effect when the server starts (the first run of the session); harmless later.
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, out_dir: str,
               args: Sequence[Any], kwargs: dict[str, Any], pg_timeout_s: float, stack_dump_s: float,
               env: dict[str, str]) -> None:
    os.environ.update(env)
    out = Path(out_dir)
    # If this rank hangs, its stacks land in a file the parent shows before killing it.
    stacks = open(out / f"rank{rank}.stacks", "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.dump_traceback_later(stack_dump_s, exit=False, file=stacks)
    # A forkserver child inherits "forkserver" as its start method; a rank launched by torchrun
    # on Linux has "fork", and DataLoader workers must fork from the rank, not start afresh.
    mp.set_start_method("fork", force=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # never depend on the host name resolving
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # Gloo connects its full mesh lazily per pair: a rank that returned from init and tore
        # the group down at once could cut a peer still connecting. Everyone meets here first.
        dist.barrier()
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        payload = ("ok", result)
    except BaseException as exc:  # report everything, including SystemExit from a rank
        payload = ("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    faulthandler.cancel_dump_traceback_later()
    try:
        data = pickle.dumps(payload)
    except Exception as exc:
        data = pickle.dumps(("err", f"rank {rank} returned something unpicklable: {exc!r}"))
    tmp = out / f"rank{rank}.pkl.tmp"
    tmp.write_bytes(data)
    tmp.rename(out / f"rank{rank}.pkl")


def run_distributed(
    fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0, env: dict[str, str] | None = None,
) -> list[Any]:
    """``[fn(rank, world_size, *args, **kwargs) for rank in range(world_size)]``, each in its own
    process of one gloo group. ``fn`` must be importable (a module-level function)."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="pid-dist-") as tmp:
        init_method = f"file://{Path(tmp) / 'store'}"
        pg_timeout = max(5.0, timeout - 10.0)
        stack_dump = max(1.0, timeout - 3.0)
        procs = [
            ctx.Process(
                target=_rank_main, name=f"rank{r}",
                args=(fn, r, world_size, init_method, tmp, tuple(args), dict(kwargs or {}), pg_timeout, stack_dump,
                      dict(env or {})),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].terminate()
        for r in hung:
            procs[r].join(KILL_GRACE_S)
            if procs[r].is_alive():
                procs[r].kill()
                procs[r].join()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for r, p in enumerate(procs):
            f = Path(tmp) / f"rank{r}.pkl"
            if f.exists():
                status, value = pickle.loads(f.read_bytes())
                (results if status == "ok" else errors)[r] = value
            elif r not in hung:
                errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
        if hung:
            for r in hung:
                f = Path(tmp) / f"rank{r}.stacks"
                errors[r] = "stacks before the kill:\n" + (f.read_text() if f.exists() else "(none)")
            raise DistributedTimeout(
                f"{getattr(fn, '__name__', fn)}: ranks {hung} still running after {timeout:.0f}s (killed)"
                + "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items())),
                errors,
            )
        if errors:
            raise DistributedRunError(
                f"{getattr(fn, '__name__', fn)}: ranks {sorted(errors)} failed"
                + "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items())),
                errors,
            )
        return [results[r] for r in range(world_size)]


def slice_order(per_rank: list[list[list[Any]]]) -> list[Any]:
    """Step by step, rank by rank: how the ranks' batches make up one global order (each rank's
    batches given in its own order; every rank must have as many)."""
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1, f"ranks have different batch counts: {[len(b) for b in per_rank]}"
    return [s for k in range(steps.pop()) for batches in per_rank for s in batches[k]]
