"""A Dagster run's hold on its source's output, from its first build step to its end.

The build lock (``output_lock.py``) and the S3 build lease (``commit/lease.py``) are held by a
process while it runs a build step, and let go when that step ends. A Dagster build run is many
steps (``sample_set``, ``plan``, write tasks, ``collect``, key indexes, manifests), often each
in its own process; between two of them nothing held the output, and a ``pid-shard`` started
then took the lock and interleaved with the run. So a run also holds the output for its whole
length: a small record, the same for a folder output and an ``s3://`` one::

    folder output:  .<name>.pid-run-hold.json beside it (like its lock)
    s3:// output:   <output>/.pid-build/run-hold.json

    {"run_hold_version": 1, "run_id": "...", "job": "source_build", "source": "photos",
     "taken": <unix s>, "renewed": <unix s>, "ttl_s": 3600.0}

* Every build step of the run takes it (the first) or renews it (the later ones), and renews it
  in the background while it runs (``RunHoldForStep``). The run's last step (``wdinfo_manifests``,
  or ``sample_set`` when it finds nothing to build) releases it, and so does a step that fails
  for good; a sensor releases it when the run ends however it ends (``defs/automation/run_holds.py``).
* ``build_lock`` and ``build_lease`` refuse while a live hold of a run exists, unless this process
  acts for that run (``acting_for``, set by the Dagster step around its work): ``pid-shard`` and
  ``pid-shard plan | commit`` stop at once with ``HeldByRunError`` naming the run (``pid-shard
  task``, which takes neither, checks first). They check once they hold the lock or lease, and a
  step takes the hold before either: of a step and a CLI build starting together, one sees the other.
* A hold is live until its last renewal plus its TTL (``PID_RUN_HOLD_TTL_S``, default an hour:
  a run lost without its end being seen blocks CLI builds of its output that long at most). A
  run waiting between two steps, for pool slots say, has no step renewing it: the sensor renews
  the hold of each source's running build run (``renew_hold``); ``held.Renewed`` says when it is live.

The record is written by another process, so it is read strictly: anything but the fields above,
in range, is ``RunHoldError`` naming the file. Every read and write goes through the storage
seam (``loader/io/objects.py``): one reader and one writer whichever the output.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loader.formats.layout import STATE_DIR, run_hold_name
from loader.formats.strict_doc import Fields, env_number, load_json_doc
from loader.io.errors import ObjectNotFoundError, PreconditionFailedError
from loader.io.objects import open_store
from pid_platform.sharding.commit.held import (
    MAX_TIME_S,
    RecordPlace,
    Renewed,
    TakenRecord,
    ago,
    utc,
)
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.layout import final_dir

log = logging.getLogger(__name__)

HOLD_FORMAT_VERSION = 1
S3_HOLD_REL = f"{STATE_DIR}/run-hold.json"
TTL_ENV = "PID_RUN_HOLD_TTL_S"
DEFAULT_TTL_S = 3600.0
MIN_TTL_S = 10.0  # renewed every third of it: a shorter one expires between two renewals of a busy machine
MAX_TTL_S = 7 * 86400.0  # a lost run blocks CLI builds of its output a week at most
MAX_RENEW_S = 300.0  # renewed at least every five minutes while a step runs, whatever the TTL
MAX_HOLD_BYTES = 4096  # one short JSON line; anything larger is not a hold
_FIX = ("if no Dagster run is building this output (the Dagster UI's Runs page shows none in progress), "
        "delete the file and build again")


class RunHoldError(BuildError):
    """A hold file this version cannot read, or a bad ``PID_RUN_HOLD_TTL_S``."""


class HeldByRunError(BuildError):
    """A Dagster run holds the output: this build stopped before touching it."""


def ttl_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``PID_RUN_HOLD_TTL_S`` when set, else ``DEFAULT_TTL_S``; checked."""
    value = env_number(TTL_ENV, environ, low=MIN_TTL_S, high=MAX_TTL_S, error=RunHoldError,
                       fix=f"give a number of seconds from {MIN_TTL_S:g} to {MAX_TTL_S:g} (how long a lost "
                           f"Dagster run's hold blocks CLI builds), or unset it (default {DEFAULT_TTL_S:g})")
    return DEFAULT_TTL_S if value is None else value


@dataclass(frozen=True)
class RunHold(Renewed):
    run_id: str
    job: str
    source: str
    taken: float
    renewed: float
    ttl_s: float

    def to_bytes(self) -> bytes:
        return json.dumps({"run_hold_version": HOLD_FORMAT_VERSION, **asdict(self)}).encode()


def parse_hold(data: bytes, where: str) -> RunHold:
    """The hold in ``data`` (read from ``where``), every field checked; ``RunHoldError`` naming the file."""
    doc = load_json_doc(data, where, max_bytes=MAX_HOLD_BYTES, fix=_FIX, error=RunHoldError)

    f = Fields(doc, where, what="a Dagster run's hold", fix=_FIX, error=RunHoldError,
               version=("run_hold_version", HOLD_FORMAT_VERSION),
               keys=("run_id", "job", "source", "taken", "renewed", "ttl_s"))
    return RunHold(f.text("run_id"), f.text("job"), f.text("source"), f.number("taken", 0, MAX_TIME_S),
                   f.number("renewed", 0, MAX_TIME_S), f.number("ttl_s", MIN_TTL_S, MAX_TTL_S))


HoldPlace = RecordPlace[RunHold]


def hold_place(output: S3Output | str | os.PathLike[str]) -> HoldPlace:
    """The hold of an ``s3://`` output, or of a folder output (``out``: the folder or a link to it)."""
    if isinstance(output, S3Output):
        store, key, name = output.store(), output.key(S3_HOLD_REL), str(output)
    else:
        final = final_dir(output)
        store, key, name = open_store(final.parent), run_hold_name(final.name), str(Path(output))
    return HoldPlace(store, key, parse_hold, MAX_HOLD_BYTES, name)


# The Dagster run this process builds for, set by its step around the work (``acting_for``); a
# process-wide value, not a context variable: a step's helpers may take the lock on another thread.
_acting_for: str | None = None


@contextmanager
def acting_for(run_id: str) -> Iterator[None]:
    """Inside the block, this process builds for Dagster run ``run_id``: that run's hold lets it pass."""
    global _acting_for
    before, _acting_for = _acting_for, run_id
    try:
        yield
    finally:
        _acting_for = before


def held_by_run(place: HoldPlace, hold: RunHold, now: float) -> HeldByRunError:
    return HeldByRunError(
        f"{place.output} is being built by Dagster run {hold.run_id} ({hold.job}, source {hold.source}), which "
        f"took it {ago(now - hold.taken)} ago (renewed {ago(now - hold.renewed)} ago); this build stopped before "
        "touching it. Wait for that run to end (the Dagster UI's Runs page shows it). If that run is not on the "
        f"Runs page or has ended, delete {place.where}, or wait until the hold expires at {utc(hold.deadline)}")


def refuse_if_held(output: S3Output | str | os.PathLike[str], *, now: Callable[[], float] = time.time) -> None:
    """Called by ``build_lock`` and ``build_lease`` before they take anything: ``HeldByRunError``
    when a Dagster run other than the one this process acts for holds ``output``."""
    place = hold_place(output)
    got = place.read()
    if got is None:
        return
    hold, t = got[0], now()
    if hold.live(t) and hold.run_id != _acting_for:
        raise held_by_run(place, hold, t)


def release_hold(output: S3Output | str | os.PathLike[str] | HoldPlace, run_id: str) -> bool:
    """Delete ``output``'s hold if it is ``run_id``'s (any other run's stays); True if it was."""
    place = output if isinstance(output, RecordPlace) else hold_place(output)
    try:
        got = place.read()
    except RunHoldError:
        return False  # not one this code wrote: it stays, and names itself to whoever meets it
    # False when taken over or released meanwhile
    return got is not None and got[0].run_id == run_id and place.delete(got[1])


def renew_hold(output: S3Output | str | os.PathLike[str], run_id: str, *,
               now: Callable[[], float] = time.time) -> bool:
    """Renew ``output``'s hold if it is ``run_id``'s (``run_holds_sensor``: a run waiting between
    two steps, for pool slots say, has no step renewing it); True if it was renewed."""
    try:
        return renew_hold_at(hold_place(output), run_id, now()) is not None
    except (RunHoldError, PreconditionFailedError, ObjectNotFoundError):
        return False  # not one this code wrote, or changed meanwhile by a step that renewed it


def renew_hold_at(place: HoldPlace, run_id: str, now: float) -> RunHold | None:
    """The hold at ``place`` renewed at ``now`` if it is ``run_id``'s; ``None`` when it is gone
    or another run's. Conditional on the ETag read: a writer meanwhile wins."""
    got = place.read()
    if got is None or got[0].run_id != run_id:
        return None
    hold = replace(got[0], renewed=now)
    place.replace(hold, got[1])
    return hold


class RunHoldForStep(TakenRecord[RunHold]):
    """A build step's part in its run's hold: taken (or renewed) on enter, renewed in the
    background, kept on exit (the run's later steps renew it; its end releases it).

    ``may_take_over(run_id)``: whether a live hold of another run may be taken over (that run
    has ended, as the Dagster instance knows); otherwise the step is refused with ``HeldByRunError``.
    """

    _thread_name = "run-hold"

    def __init__(self, output: S3Output | str | os.PathLike[str], run_id: str, job: str, source: str, *,
                 may_take_over: Callable[[str], bool] = lambda run_id: False, ttl_s: float | None = None,
                 now: Callable[[], float] = time.time) -> None:
        self.place = hold_place(output)
        self.run_id, self.job, self.source = run_id, job, source
        self.ttl_s = ttl_from_env() if ttl_s is None else ttl_s
        self.renew_every_s = min(self.ttl_s / 3, MAX_RENEW_S)
        self.may_take_over = may_take_over
        self.now = now
        self.took_over: RunHold | None = None

    def _fresh(self) -> RunHold:
        t = self.now()
        return RunHold(self.run_id, self.job, self.source, t, t, self.ttl_s)

    def _over(self, held: RunHold, mine: RunHold) -> tuple[RunHold, str | None]:
        if held.run_id == self.run_id:
            return replace(mine, taken=held.taken), None
        if held.live(mine.taken) and not self.may_take_over(held.run_id):
            raise held_by_run(self.place, held, mine.taken)
        return mine, "its run has ended, or its hold expired"

    def _contended(self) -> RunHoldError:
        return RunHoldError(f"{self.place.where}: could not take the run's hold (others kept changing it); "
                            "re-execute the run")

    def _take(self) -> None:
        taken = self._take_record()
        if taken is not None:
            self.took_over = taken[0]

    def _renew_once(self) -> bool:
        # Read first: the run's other steps (write tasks side by side) and run_holds_sensor renew
        # it too, each changing its ETag; only a hold that is gone or another run's ends the renewals.
        try:
            renewed = renew_hold_at(self.place, self.run_id, self.now())
            if renewed is None:
                log.warning("%s: the hold of run %s was released or taken over; no longer renewing it",
                            self.place.where, self.run_id)
                return False
            self.record = renewed
        except Exception as exc:  # noqa: BLE001 - retried next period; the hold outlasts a few misses
            log.warning("%s: renewing the run's hold failed (%s); trying again", self.place.where, exc)
        return True

    def _let_go(self) -> None:
        pass  # the run's later steps renew it; its end releases it

    def release(self) -> bool:
        """Release the hold now (the run's last step, or a step that failed for good)."""
        return release_hold(self.place, self.run_id)
