"""Claims on an S3 output: records saying "this process is using that version now, until <time>".

An object store has no locks, and the processes that use one output (builds on several
machines, the cleanup job) share nothing else. A claim is a small object,
``<output>/.pid-claims/<subject>/<purpose>-<token>.json``::

    {"claim_version": 1, "subject": "<version id>", "purpose": "publish",
     "holder": "<host> pid <pid>", "expires": <unix seconds>}

held for as long as its holder works on ``subject``: renewed by a background thread every third
of its lifetime, deleted when the work ends. A holder killed with ``kill -9`` leaves it behind;
it stops counting at ``expires``. Two purposes exist today:

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
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pid_platform.sharding.commit.held import HeldInBackground
from pid_platform.sharding.errors import BuildError

if TYPE_CHECKING:
    from pid_platform.sharding.commit.s3_output import S3Output

CLAIMS_DIR = ".pid-claims"
CLAIM_FORMAT_VERSION = 1
PUBLISH = "publish"
DELETE = "delete"
DEFAULT_TTL_S = 600.0
MAX_HOLDER_CHARS = 200


def this_process() -> str:
    """How a claim (and a pointer) names the process that made it, for error messages."""
    return f"{socket.gethostname()[:100]} pid {os.getpid()}"


@dataclass(frozen=True)
class Claim:
    subject: str
    purpose: str
    holder: str
    expires: float
    key: str  # the object's key, relative to the output

    def live(self, now: float) -> bool:
        return now < self.expires

    def describe(self) -> str:
        return f"{self.purpose} claim of {self.holder} on {self.subject}"


def _rel(subject: str, purpose: str, token: str) -> str:
    return f"{CLAIMS_DIR}/{subject}/{purpose}-{token}.json"


def _parse(data: bytes, key: str) -> Claim | None:
    try:
        doc = json.loads(data)
        if doc.get("claim_version") != CLAIM_FORMAT_VERSION:
            return None
        return Claim(str(doc["subject"]), str(doc["purpose"]), str(doc["holder"])[:MAX_HOLDER_CHARS],
                     float(doc["expires"]), key)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # not a claim this version wrote: it protects nothing


def claims_on(output: S3Output, subject: str | None = None) -> list[Claim]:
    """The claims on ``subject`` (every subject when ``None``), live or not, in key order.
    A claim that vanishes between the listing and its read (released) is left out."""
    rel = f"{CLAIMS_DIR}/{subject}" if subject else CLAIMS_DIR
    prefix = output.key(rel) + "/"
    store = output.store()
    found: list[Claim] = []
    for obj in store.list(prefix):
        data = store.get_or_none(obj.key)
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
        self.ttl_s, self.now = ttl_s, now
        self.rel = _rel(subject, purpose, uuid.uuid4().hex[:16])
        self.expires = 0.0
        self._thread_name = f"claim-{purpose}"

    def _put(self) -> None:
        expires = self.now() + self.ttl_s
        doc = {"claim_version": CLAIM_FORMAT_VERSION, "subject": self.subject, "purpose": self.purpose,
               "holder": self.holder, "expires": expires}
        self.output.store().put(self.output.key(self.rel), json.dumps(doc).encode(), content_type="application/json")
        self.expires = expires

    def _take(self) -> None:
        self._put()

    def _renew_every_s(self) -> float:
        return self.ttl_s / 3

    def _renew_once(self) -> bool:
        # A missed renewal is retried next time; check() stops the holder before it matters.
        with contextlib.suppress(Exception):
            self._put()
        return True

    def _let_go(self) -> None:
        self.output.store().delete(self.output.key(self.rel))

    def check(self) -> None:
        if self.now() >= self.expires - self.ttl_s / 6:
            raise BuildError(f"{self.output}: the {self.purpose} claim on {self.subject} could not be renewed "
                             "(S3 unreachable?); other processes may no longer honour it, so this one stops")


def wait_until_unclaimed(output: S3Output, subject: str, purpose: str, *,
                         now: Callable[[], float] = time.time, poll_s: float = 0.2,
                         on_wait: Callable[[Claim], None] | None = None) -> None:
    """Return once no live claim of ``purpose`` is held on ``subject`` (a holder that dies
    leaves one that expires; a live holder releases it when done)."""
    told = False
    while True:
        live = [c for c in claims_on(output, subject) if c.purpose == purpose and c.live(now())]
        if not live:
            return
        if on_wait is not None and not told:
            on_wait(live[0])
            told = True
        time.sleep(poll_s)


def remove_expired(output: S3Output, *, now: Callable[[], float] = time.time) -> int:
    """Delete the claims of holders that stopped renewing them; returns how many."""
    t = now()
    gone = [c.key for c in claims_on(output) if not c.live(t)]
    store = output.store()
    for key in gone:
        store.delete(key)
    return len(gone)
