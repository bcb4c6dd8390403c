"""One build of an ``s3://`` output at a time, across machines: a lease object in the bucket.

The local ``flock`` (``output_lock.py``) guards a work folder on one machine; two machines
building the same ``s3://`` output have different work folders and would race. A build of an
S3 output therefore holds ``<output>/.pid-build/lease.json``::

    {"lease_version": 1, "host": "...", "pid": 1234, "token": "<random>", "started": <unix s>,
     "renewed": <unix s>, "expires": <unix s>, "ttl_s": 600.0, "version": "<id>" | null,
     "boot": "<boot id>", "pidns": <pid namespace inode>, "pid_start": <clock ticks>}

* taken with a conditional create (``If-None-Match: *``): of two builds, one gets it, the other
  is refused with the holder's host, pid, age and when its lease expires;
* renewed by a background thread with ``If-Match`` on the lease's own ETag, so a renewal never
  overwrites a lease another build has taken: a holder whose lease was taken (it expired while
  the holder stalled, or someone deleted it) sees that and stops before the pointer switch
  (``check_held``, called by the commit) with an error saying so;
* released (deleted, ``If-Match`` its ETag) when the build ends; a holder killed with
  ``kill -9`` leaves it behind, and the next build takes it over with ``If-Match`` on the stale
  lease's ETag (of two builds taking over, one wins): at once when the holder ran on this machine
  and its process is gone (same host, boot and pid namespace; the pid free, a zombie or reused
  by another process start: ``holder_process.py``), else once the lease is stale.

A lease is stale at its last renewal plus its TTL (or at ``expires`` if earlier), whatever
``expires`` claims, and not honoured further ahead than ``held.Renewed`` allows. Numbers that
are not finite, not JSON, or out of range (a TTL outside ``[MIN_TTL_S, MAX_TTL_S]``, a time before 1970 or past
the year 5000, a pid past 2**31) make the lease unreadable: ``BuildLeaseError`` naming the file.
The TTL is bounded to ``[MIN_TTL_S, MAX_TTL_S]`` (2 s to a day) and the renewal period to
``[MIN_RENEW_S, TTL / 2]`` (at least a second: one conditional PUT a second at most).

A server that does not implement ``If-None-Match`` on PUT (it answers 501) gets a weaker take:
a read that finds no lease, an unconditional write, and a read-back of the token. Expiry is read
on the reader's clock: machines whose clocks differ by more than the TTL defeat it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from loader.formats.strict_doc import Fields, env_number, load_json_doc
from loader.io.errors import (
    PreconditionFailedError,
    StorageError,
    UnsupportedRequestError,
)
from pid_platform.sharding.commit.held import (
    MAX_TIME_S,
    OncePerProcess,
    RecordPlace,
    Renewed,
    TakenRecord,
    ago,
    checked_seconds,
    utc,
)
from pid_platform.sharding.commit.holder_process import HolderProcess
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.run_hold import refuse_if_held

if TYPE_CHECKING:
    from pid_platform.sharding.commit.s3_output import S3Output

log = logging.getLogger(__name__)

LEASE_REL = ".pid-build/lease.json"
LEASE_FORMAT_VERSION = 1
TTL_ENV = "PID_LEASE_TTL_S"
RENEW_ENV = "PID_LEASE_RENEW_S"
DEFAULT_TTL_S = 600.0
MIN_TTL_S = 2.0  # a renewal every second at least, twice per TTL
MAX_TTL_S = 86400.0  # a killed build on another machine blocks its output for a day at most
MIN_RENEW_S = 1.0  # one conditional PUT a second at most
MAX_PID = 2**31 - 1
MAX_LEASE_BYTES = 4096  # a lease is one short JSON line; anything larger is not one


# --- Settings -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LeaseSettings:
    """How long a lease lasts without renewal (``ttl_s``) and how often its holder renews it
    (``renew_s``, default a third of the TTL). A crashed build blocks the output for at most
    ``ttl_s``; a holder that cannot renew for that long loses the lease."""

    ttl_s: float = DEFAULT_TTL_S
    renew_s: float | None = None

    def __post_init__(self) -> None:
        checked_seconds(self.ttl_s, MIN_TTL_S, MAX_TTL_S, "build lease ttl_s",
                        "a shorter lease expires between two renewals of a busy machine; a build killed on "
                        "another machine blocks its output for a whole TTL")
        if self.renew_s is not None:
            checked_seconds(self.renew_s, MIN_RENEW_S, self.ttl_s / 2, "build lease renew_s",
                            "each renewal is a conditional PUT; renewed at least twice per TTL (renew_s <= "
                            "ttl_s / 2), one missed renewal does not lose it")

    @property
    def renew_every_s(self) -> float:
        return self.renew_s if self.renew_s is not None else self.ttl_s / 3

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LeaseSettings:
        """The defaults, overridden by ``PID_LEASE_TTL_S`` / ``PID_LEASE_RENEW_S`` when set."""
        fix = "give a number of seconds, or unset it"
        values = {name: env_number(var, environ, fix=fix, error=BuildError)
                  for name, var in (("ttl_s", TTL_ENV), ("renew_s", RENEW_ENV))}
        try:
            return cls(**{name: value for name, value in values.items() if value is not None})
        except BuildError as exc:
            raise BuildError(f"{exc} (from {TTL_ENV} / {RENEW_ENV})") from None


# --- The lease ----------------------------------------------------------------------------------

class BuildLeaseError(BuildError):
    pass


class BuildLeaseHeldError(BuildLeaseError):
    """Another build holds a live lease on the output."""


class BuildLeaseLostError(BuildLeaseError):
    """This build's lease was taken by another build, or could not be renewed in time."""


@dataclass(frozen=True)
class LeaseRecord(Renewed):
    host: str
    pid: int
    token: str
    started: float
    renewed: float
    expires: float
    ttl_s: float
    version: str | None = None
    boot: str | None = None  # the holder's machine boot, pid namespace and process start
    pidns: int | None = None  # (holder_process.py): None in a lease from an older version
    pid_start: int | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"lease_version": LEASE_FORMAT_VERSION, **asdict(self)}).encode()

    def holder(self) -> str:
        return f"{self.host} pid {self.pid}"

    def process(self) -> HolderProcess:
        return HolderProcess(self.host, self.pid, self.boot, self.pidns, self.pid_start)


_LEASE_FIX = "if no build of this output is running, delete it and build again"


def parse_lease(data: bytes, where: str) -> LeaseRecord:
    """The lease in ``data`` (read from ``where``), every field checked: a lease another program
    or person wrote, with ``1e400`` or a ten-digit pid, is a ``BuildLeaseError`` naming the file."""
    doc = load_json_doc(data, where, max_bytes=MAX_LEASE_BYTES, fix=_LEASE_FIX, error=BuildLeaseError)
    f = Fields(doc, where, what="a build lease", fix=_LEASE_FIX, error=BuildLeaseError,
               version=("lease_version", LEASE_FORMAT_VERSION))
    return LeaseRecord(
        f.text("host", 100, cut=True), f.number("pid", 1, MAX_PID, whole=True), f.text("token", 64, cut=True),
        f.number("started", 0, MAX_TIME_S), f.number("renewed", 0, MAX_TIME_S),
        f.number("expires", 0, MAX_TIME_S), f.number("ttl_s", MIN_TTL_S / 2, MAX_TTL_S),
        f.text("version", 128, cut=True, optional=True), f.text("boot", 64, cut=True, optional=True),
        f.number("pidns", 0, 2**64, whole=True, optional=True),
        f.number("pid_start", 0, 2**63, whole=True, optional=True))


class BuildLease(TakenRecord[LeaseRecord]):
    """The lease on one S3 output: taken on enter, renewed in the background, released on exit.

    ``check()`` raises ``BuildLeaseLostError`` once the lease is no longer this build's; the
    commit calls it (through ``check_held``) right before it switches the pointer.
    """

    def __init__(self, output: S3Output, settings: LeaseSettings | None = None, *,
                 now: Callable[[], float] = time.time) -> None:
        self.output = output
        self.settings = settings or LeaseSettings.from_env()
        self.renew_every_s = self.settings.renew_every_s
        self.now = now
        self.place = RecordPlace(output.store(), output.key(LEASE_REL), parse_lease, MAX_LEASE_BYTES, str(output))
        self.where = f"{output}/{LEASE_REL}"
        self.lost: str | None = None
        self._lock = threading.Lock()  # one request at a time changes record/etag

    # Taking it.
    def _fresh(self, started: float | None = None, version: str | None = None) -> LeaseRecord:
        t = self.now()
        me = HolderProcess.this()
        return LeaseRecord(me.host, me.pid, self.record.token if self.record else uuid.uuid4().hex,
                           started if started is not None else t, t, t + self.settings.ttl_s,
                           self.settings.ttl_s, version, me.boot, me.pidns, me.start)

    def _refuse(self, held: LeaseRecord) -> BuildLeaseHeldError:
        t = self.now()
        expiry = f"expires at {utc(held.deadline)} (in {ago(held.deadline - t)})"
        here = (f"that process is still running on this machine; if it hangs, stop it and build again (the "
                f"lease of a gone process is taken over at once; this one {expiry})"
                if held.process().on_this_machine() else
                f"if that process is gone, its lease {expiry} and the next build takes it over (one on "
                "its own machine at once)")
        return BuildLeaseHeldError(
            f"another build of {self.output} is running: {held.holder()} took its lease {ago(t - held.started)} ago "
            f"(renewed {ago(t - held.renewed)} ago{', version ' + held.version if held.version else ''}); wait for "
            f"it to finish. {here[0].upper()}{here[1:]}; {self.where} never needs deleting by hand")

    def _over(self, held: LeaseRecord, mine: LeaseRecord) -> tuple[LeaseRecord, str]:
        """``mine`` over ``held`` when it may be taken over now, with why; else the build is refused."""
        t = self.now()
        if t >= held.deadline:
            return mine, f"which went stale at {utc(held.deadline)} (that build stopped without releasing it)"
        if held.deadline > t + 2 * held.ttl_s:
            return mine, (f"whose deadline {utc(held.deadline)} lies further ahead than a lease of {held.ttl_s:g} s "
                          "can (a forged record, or that machine's clock is more than a TTL ahead)")
        if held.process().gone():
            return mine, "whose process is gone (this machine, same boot: killed, or its pid reused by another process)"
        raise self._refuse(held)

    def _create(self, mine: LeaseRecord) -> str | None:
        try:
            return self.place.create(mine)
        except UnsupportedRequestError:
            pass
        # A server without If-None-Match: write (there was none when read), read back the token. Two
        # builds starting within one round trip can both pass the read; the read-back catches most of those.
        self.place.replace(mine, None)
        back = self.place.read()
        if back is None or back[0].token != mine.token:
            raise PreconditionFailedError(f"{self.where}: another build wrote its lease at the same time")
        return back[1]

    def _contended(self) -> BuildLeaseError:
        return BuildLeaseError(f"{self.where}: could not take the build lease (other builds kept taking and "
                               "releasing it); build again")

    def acquire(self) -> None:
        taken = self._take_record()
        if taken is not None:
            log.warning("%s: took over the lease of %s, %s", self.output, taken[0].holder(), taken[1])

    # Holding it.
    def renew(self, version: str | None = None) -> None:
        """Extend the lease (recording ``version`` when given); raises once it is lost."""
        with self._lock:
            if self.lost is not None:
                raise BuildLeaseLostError(self.lost)
            assert self.record is not None
            rec = self._fresh(self.record.started, version or self.record.version)
            try:
                self.etag = self.place.replace(rec, self.etag)
            except PreconditionFailedError:
                self.lost = self._lost_message("another build took it over or it was deleted")
                raise BuildLeaseLostError(self.lost) from None
            self.record = rec

    def _lost_message(self, why: str) -> str:
        try:
            now_there = self.place.read()
        except BuildLeaseError:
            now_there = None
        holder = "" if now_there is None else \
            f" (now held by {now_there[0].holder()}, since {ago(self.now() - now_there[0].started)})"
        return (f"{self.output}: this build lost its lease {self.where}{holder}: {why}. It stops without switching "
                f"the pointer, so readers keep the version they had; build again once the other build is done")

    def check(self, version: str | None = None) -> None:
        """Raise ``BuildLeaseLostError`` unless the lease is still this build's: one conditional
        renewal, so a lease taken meanwhile is seen even between two background renewals."""
        if self.record is not None and self.now() >= self.record.expires and self.lost is None:
            self.lost = self._lost_message(f"it could not be renewed before it expired at {utc(self.record.expires)} "
                                           "(S3 unreachable, or the process stalled)")
        try:
            self.renew(version)
        except StorageError as exc:
            raise BuildLeaseError(f"{exc} (renewing the build lease {self.where}; the pointer was not changed)") from None

    _thread_name = "build-lease"

    def _renew_once(self) -> bool:
        try:
            self.renew()
        except BuildLeaseLostError as exc:
            log.error("%s", exc)
            return False
        except Exception as exc:  # noqa: BLE001 - a failed renewal is retried; check() stops the build in time
            log.warning("%s: renewing the build lease failed (%s); trying again in %.0f s", self.output,
                        exc, self.renew_every_s)
        return True

    # Letting it go.
    def release(self) -> None:
        with self._lock:
            if self.lost is not None or self.etag is None:
                return  # not ours any more: someone else's lease stays
            try:
                self.place.delete(self.etag)  # False: taken over meanwhile
            except UnsupportedRequestError:
                got = self.place.get()
                if got is not None and got[1] == self.etag:
                    self.place.delete(None)
            finally:
                self.etag = None

    def _take(self) -> None:
        try:
            self.acquire()
        except StorageError as exc:
            raise BuildLeaseError(f"{exc} (taking the build lease {self.where}; nothing was built)") from None

    def _let_go(self) -> None:
        self.release()


_held = OncePerProcess()  # output URL -> its lease


@contextmanager
def _taken(output: S3Output, settings: LeaseSettings | None) -> Iterator[BuildLease]:
    with BuildLease(output, settings) as lease:
        refuse_if_held(output)  # holding the lease, as build_lock checks holding the lock (run_hold.py)
        yield lease


def build_lease(output: S3Output, settings: LeaseSettings | None = None) -> AbstractContextManager[BuildLease]:
    """Hold the build lease of ``output`` for the block (nested holds in one process share it)."""
    return _held.hold(output.url, lambda: _taken(output, settings))


def check_held(output: S3Output, version: str | None = None) -> None:
    """Before a commit: raise ``BuildLeaseLostError`` if this process held the lease of ``output``
    and lost it (a no-op for a publish outside a leased build)."""
    lease = _held.get(output.url)
    if lease is not None:
        lease.check(version)
