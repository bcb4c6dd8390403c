"""What the build lease, the claims and a Dagster run's hold share: a record its holder renews,
held for the length of a ``with`` block (taken on enter, renewed by a daemon thread, let go on
exit), once per process however deep the steps that take it nest. The lease and a run's hold are
one record per output (``RecordPlace``), taken the same way (``TakenRecord``).

A let-go that fails is raised only when the block itself succeeded: what is left behind expires
on its own, and the block's own error is the one worth reading.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar

from loader.formats.errors import short_repr
from loader.io.errors import ObjectNotFoundError, PreconditionFailedError
from loader.io.objects import ObjectStore
from pid_platform.sharding.errors import BuildError

T = TypeVar("T")
JSON = "application/json"
MAX_TIME_S = 1e11  # the year 5138: a time in a record past it is not one this code wrote


def checked_seconds(value: object, low: float, high: float, name: str, why: str) -> float:
    """``value`` as a number of seconds in ``[low, high]`` (a TTL, a renewal period): else
    ``BuildError`` naming ``name`` and its value, and saying ``why`` these bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise BuildError(f"{name} = {short_repr(value)}: give {low:g} to {high:g} seconds ({why})")
    return float(value)


def ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class Renewed:
    """A record its holder renews: ``live`` until its ``deadline``, and never further ahead than
    two TTLs (the holder's clock may run up to a TTL ahead of the reader's; a record "until
    2036", forged or from a clock further ahead, is not honoured)."""

    renewed: float | None
    ttl_s: float

    @property
    def deadline(self) -> float:
        """When it stops counting: its last renewal plus its TTL, or the ``expires`` it states if
        that is earlier (the lease and a claim state one, a run's hold none; a claim written by an
        older version, without ``renewed``, is judged by ``expires`` alone)."""
        stated = getattr(self, "expires", math.inf)
        return stated if self.renewed is None else min(stated, self.renewed + self.ttl_s)

    def live(self, now: float) -> bool:
        return now < self.deadline <= now + 2 * self.ttl_s


_NOT_HELD = object()


class OncePerProcess:
    """What this process holds, by key, taken once: steps nest (the one-process build runs every
    stage, each of which takes the lock or lease), and a nested take shares the outer one."""

    def __init__(self) -> None:
        self._held: dict[Hashable, Any] = {}

    def get(self, key: Hashable) -> Any | None:
        return self._held.get(key)

    @contextmanager
    def hold(self, key: Hashable, take: Callable[[], AbstractContextManager[T]]) -> Iterator[T]:
        outer = self._held.get(key, _NOT_HELD)
        if outer is not _NOT_HELD:
            yield outer
            return
        with take() as taken:
            self._held[key] = taken
            try:
                yield taken
            finally:
                del self._held[key]


class HeldInBackground:
    """Subclasses say how to take it (``_take``), renew it once (``_renew_once``; False stops the
    renewals), how often (``renew_every_s``, set when made) and how to let it go (``_let_go``)."""

    renew_every_s: float
    _thread_name = "renewal"
    _stop: threading.Event | None = None
    _thread: threading.Thread | None = None

    def _take(self) -> None:
        raise NotImplementedError

    def _renew_once(self) -> bool:
        raise NotImplementedError

    def _let_go(self) -> None:
        raise NotImplementedError

    def _renewals(self, stop: threading.Event) -> None:
        while not stop.wait(self.renew_every_s):
            if not self._renew_once():
                return

    def __enter__(self) -> Self:
        self._take()
        self._stop = stop = threading.Event()
        self._thread = threading.Thread(target=self._renewals, args=(stop,), name=self._thread_name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._let_go()
        except Exception:  # noqa: BLE001 - what is left behind only lasts until it expires
            if exc[0] is None:
                raise


class Record(Protocol):
    def to_bytes(self) -> bytes: ...


R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class RecordPlace(Generic[R]):
    """Where one output's record is (its build lease, its run's hold): an object of a store, read
    strictly (``parse`` raises naming it) and changed only on the condition of its ETag."""

    store: ObjectStore
    key: str
    parse: Callable[[bytes, str], R]
    max_bytes: int  # one short JSON line: a longer object is no record (``parse`` refuses it)
    output: str  # the output it guards, for messages

    @property
    def where(self) -> str:
        return self.store.url(self.key)

    def get(self) -> tuple[bytes, str | None] | None:
        """Its bytes (at most ``max_bytes + 1``) and ETag, or ``None`` when there is none."""
        try:
            return self.store.get_tagged(self.key, max_bytes=self.max_bytes + 1)
        except ObjectNotFoundError:
            return None

    def read(self) -> tuple[R, str | None] | None:
        got = self.get()
        return None if got is None else (self.parse(got[0], self.where), got[1])

    def create(self, record: R) -> str | None:
        """Write it where there is none; its ETag. ``PreconditionFailedError`` if there is one."""
        return self.store.put_if_absent(self.key, record.to_bytes(), content_type=JSON)

    def replace(self, record: R, etag: str | None) -> str | None:
        """Write it over the one of ETag ``etag`` (None: over any); ``PreconditionFailedError`` if changed or gone."""
        if etag is None:
            return self.store.put(self.key, record.to_bytes(), content_type=JSON)
        return self.store.put_if_match(self.key, record.to_bytes(), etag, content_type=JSON)

    def delete(self, etag: str | None) -> bool:
        """Delete it if its ETag is still ``etag``; False when it changed or is gone."""
        try:
            self.store.delete(self.key, if_match=etag)
        except (PreconditionFailedError, ObjectNotFoundError):
            return False
        return True


class TakenRecord(HeldInBackground, Generic[R]):
    """A record at ``place`` this process takes: ``_fresh()`` with a conditional create where there
    is none, else ``_over`` the one there (it raises to refuse) with a replace conditional on the
    ETag read; of two takers one wins, the other reads again. ``record``: what it last wrote there
    (taken or renewed); ``etag``: what its take got (the lease keeps it current: it renews on it)."""

    place: RecordPlace[R]
    record: R | None = None
    etag: str | None = None
    _fresh: Callable[[], R]  # this holder's record, as of now
    # (held, mine) -> what to write over held, and why it may be taken over (None: it is this holder's)
    _over: Callable[[R, R], tuple[R, str | None]]
    _contended: Callable[[], BuildError]  # the error once every try lost a race

    def _create(self, mine: R) -> str | None:  # the lease's also works on servers without If-None-Match
        return self.place.create(mine)

    def _take_record(self) -> tuple[R, str] | None:
        """Take it; the record it took over and why, if it did."""
        for _ in range(5):  # each turn loses one race to another writer of the record
            mine, got = self._fresh(), self.place.read()
            try:
                if got is None:
                    self.etag, self.record = self._create(mine), mine
                    return None
                mine, why = self._over(got[0], mine)
                self.etag, self.record = self.place.replace(mine, got[1]), mine
                return None if why is None else (got[0], why)
            except PreconditionFailedError:
                continue
        raise self._contended()
