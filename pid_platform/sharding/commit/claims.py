"""Claims on an S3 output: records saying "this process is using that version now, until <time>".

An object store has no locks, and the processes that use one output (builds on several
machines, the cleanup job) share nothing else. A claim is a small object,
``<output>/.pid-claims/<subject>/<purpose>-<token>.json``::

    {"claim_version": 1, "subject": "<version id>", "purpose": "publish",
     "holder": "<host> pid <pid>", "expires": <unix seconds>, "renewed": <unix seconds>,
     "ttl_s": <seconds>}

held for as long as its holder works on ``subject``: renewed by a background thread every third
of its lifetime (``ttl_s``, bounded to ``[MIN_TTL_S, MAX_TTL_S]``), deleted when the work ends.
A holder killed with ``kill -9`` leaves it behind; it stops counting as a lease does
(``lease.py``). One that is not a claim this version reads (not JSON, ``1e400``, a wrong type)
protects nothing: it is skipped with a warning naming the object. Every wait for a claim is bounded
(``wait_until_unclaimed``'s ``max_wait_s``) and fails naming the claim. Two purposes exist today:

* ``publish``: a build is uploading, checking or switching the pointer to that version;
* ``delete``: the cleanup is about to delete that version.

Each side writes its own claim first and reads the other's after, so at least one sees the
other (S3 reads are strongly consistent after a write): a cleanup that finds a ``publish``
claim keeps the version, a build that finds a ``delete`` claim waits until it is gone and then
lists what is left. One build per output is a different record, exclusive by a conditional
create: the build lease (``lease.py``).

Expiry is read on each reader's clock: machines whose clocks differ by more than a claim's
lifetime (10 minutes by default) defeat it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loader.formats.strict_doc import Fields, load_json_doc
from pid_platform.sharding.commit.held import MAX_TIME_S, HeldInBackground, Renewed, checked_seconds
from pid_platform.sharding.errors import BuildError

if TYPE_CHECKING:
    from pid_platform.sharding.commit.s3_output import S3Output

CLAIMS_DIR = ".pid-claims"
CLAIM_FORMAT_VERSION = 1
PUBLISH = "publish"
DELETE = "delete"
log = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0
MIN_TTL_S = 1.0  # renewed every third of it: three PUTs a second at most
MAX_TTL_S = 86400.0  # a killed holder's claim counts for a day at most
DEFAULT_MAX_WAIT_S = 3 * DEFAULT_TTL_S  # a cleanup deletes a version in minutes; past this, stop
MAX_CLAIM_BYTES = 4096
MAX_HOLDER_CHARS = 200
_SKIPPED = "it protects nothing and is skipped"


def this_process() -> str:
    """How a claim (and a pointer) names the process that made it, for error messages."""
    return f"{socket.gethostname()[:100]} pid {os.getpid()}"


@dataclass(frozen=True)
class Claim(Renewed):
    subject: str
    purpose: str
    holder: str
    expires: float
    key: str  # the object's key, relative to the output
    renewed: float | None = None  # None: written by an older version (judged by expires alone)
    ttl_s: float = DEFAULT_TTL_S

    def describe(self) -> str:
        return f"{self.purpose} claim of {self.holder} on {self.subject}"


class _NotAClaim(ValueError):
    pass


def _parse(data: bytes, key: str) -> Claim | None:
    """The claim in ``data``; None (with a warning naming ``key``) when it is not one this version
    wrote: it then protects nothing, and is never deleted here either (it is not ours)."""
    try:
        doc = load_json_doc(data, key, max_bytes=MAX_CLAIM_BYTES, fix=_SKIPPED, error=_NotAClaim)
        f = Fields(doc, key, what="a claim", fix=_SKIPPED, error=_NotAClaim,
                   version=("claim_version", CLAIM_FORMAT_VERSION))
        # renewed and ttl_s may be missing (a claim of an older version), never null
        ttl = f.number("ttl_s", MIN_TTL_S, MAX_TTL_S, optional="ttl_s" not in doc)
        return Claim(f.text("subject", None, cut=True), f.text("purpose", None, cut=True),
                     f.text("holder", MAX_HOLDER_CHARS, cut=True), f.number("expires", 0, MAX_TIME_S), key,
                     f.number("renewed", 0, MAX_TIME_S, optional="renewed" not in doc),
                     DEFAULT_TTL_S if ttl is None else ttl)
    except _NotAClaim as exc:
        log.warning("%s", exc)
        return None


def claims_on(output: S3Output, subject: str | None = None) -> list[Claim]:
    """The claims on ``subject`` (every subject when ``None``), live or not, in key order.
    A claim that vanishes between the listing and its read (released) is left out."""
    rel = f"{CLAIMS_DIR}/{subject}" if subject else CLAIMS_DIR
    prefix = output.key(rel) + "/"
    store = output.store()
    found: list[Claim] = []
    for obj in store.list(prefix):
        # One past the cap is enough to refuse a claim too long: a co-tenant's 1 GB object there
        # is not read whole.
        data = store.get_or_none(obj.key, max_bytes=MAX_CLAIM_BYTES + 1)
        claim = _parse(data, obj.key) if data is not None else None
        if claim is not None:
            found.append(claim)
    return sorted(found, key=lambda c: c.key)


class HeldClaim(HeldInBackground):
    """A claim written on enter, renewed in the background, deleted on exit.

    ``check()`` raises when renewals have failed for so long that the claim may have expired
    (another process may then have acted as if it did not exist).
    """

    def __init__(self, output: S3Output, subject: str, purpose: str, *, holder: str | None = None,
                 ttl_s: float = DEFAULT_TTL_S, now: Callable[[], float] = time.time) -> None:
        self.output, self.subject, self.purpose = output, subject, purpose
        self.holder = (holder or this_process())[:MAX_HOLDER_CHARS]
        self.ttl_s = checked_seconds(ttl_s, MIN_TTL_S, MAX_TTL_S, f"a {purpose} claim's ttl_s",
                                     "renewed every third of it; a killed holder's claim counts that long")
        self.now = now
        self.renew_every_s = self.ttl_s / 3
        self.rel = f"{CLAIMS_DIR}/{subject}/{purpose}-{uuid.uuid4().hex[:16]}.json"
        self.expires = 0.0
        self._thread_name = f"claim-{purpose}"

    def _take(self) -> None:
        t = self.now()
        expires = t + self.ttl_s
        doc = {"claim_version": CLAIM_FORMAT_VERSION, "subject": self.subject, "purpose": self.purpose,
               "holder": self.holder, "expires": expires, "renewed": t, "ttl_s": self.ttl_s}
        self.output.store().put(self.output.key(self.rel), json.dumps(doc).encode(), content_type="application/json")
        self.expires = expires

    def _renew_once(self) -> bool:
        # A missed renewal is retried next time; check() stops the holder before it matters.
        with contextlib.suppress(Exception):
            self._take()
        return True

    def _let_go(self) -> None:
        self.output.store().delete(self.output.key(self.rel))

    def check(self) -> None:
        if self.now() >= self.expires - self.ttl_s / 6:
            raise BuildError(f"{self.output}: the {self.purpose} claim on {self.subject} could not be renewed "
                             "(S3 unreachable?); other processes may no longer honour it, so this one stops")


class ClaimWaitTimeout(BuildError):
    """A claim stayed live for longer than its waiter may wait."""


def wait_until_unclaimed(output: S3Output, subject: str, purpose: str, *,
                         now: Callable[[], float] = time.time, poll_s: float = 0.2,
                         on_wait: Callable[[Claim], None] | None = None,
                         max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
    """Return once no live claim of ``purpose`` is held on ``subject`` (a holder that dies
    leaves one that goes stale within its TTL; a live holder releases it when done). After
    ``max_wait_s`` (on the monotonic clock) raise ``ClaimWaitTimeout`` naming the claim: a
    waiter holding the build lease must not hold it forever."""
    told = False
    give_up = time.monotonic() + max_wait_s
    while True:
        live = [c for c in claims_on(output, subject) if c.purpose == purpose and c.live(now())]
        if not live:
            return
        if on_wait is not None and not told:
            on_wait(live[0])
            told = True
        if time.monotonic() >= give_up:
            c = live[0]
            raise ClaimWaitTimeout(
                f"{output}: waited {max_wait_s:g} s for the {c.describe()} (s3://{output.bucket}/{c.key}), still "
                "renewed; nothing was switched. Build again once "
                "that process is done (if it is gone, its claim stops counting within its TTL)")
        time.sleep(poll_s)


def remove_expired(output: S3Output, *, now: Callable[[], float] = time.time) -> int:
    """Delete the claims of holders that stopped renewing them; returns how many."""
    t = now()
    gone = [c.key for c in claims_on(output) if not c.live(t)]
    store = output.store()
    for key in gone:
        store.delete(key)
    return len(gone)
