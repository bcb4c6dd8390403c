"""What the stages of a build report and refuse with, for a folder and a bucket alike: a task's
outcome, the plan's, the errors that name the ``pid-shard`` command to run next, and the pause
points the kill tests hold a write task at."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

from pid_platform.sharding.commit.state import REPORT, load_intake_settings, state_dir
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL
from pid_platform.sharding.intake.task import (
    IntakeReport,
    slice_bounds,
)
from pid_platform.sharding.state_doc import load_state_doc

# Held (PID_PAUSE_AT) once a write task has put one shard's outputs in place: tests kill it there.
SHARD_DONE_POINT = "write-task:shard-done"


def shard_done_point(index: int, of: int) -> str:
    """The same point in write task ``index`` of ``of`` only: a test holds (or fails) one task."""
    return f"write-task-{index}-of-{of}:shard-done"


class TaskOrderError(BuildError):
    """A task ran before the one it needs (a write task or commit before the plan). Its message is
    the raiser's (the sharding layer's: ``facts``, then which ``pid-shard`` command to run); a
    Dagster step raises it again with its own advice after ``facts``: an operator in the UI types
    no command."""

    def __init__(self, facts: str, advice: str) -> None:
        super().__init__(f"{facts}; {advice}")
        self.facts = facts


@dataclass(frozen=True)
class Unfinished:
    """Why a staged plan cannot be committed yet: the facts (which tasks, where their records are
    missing) and what a ``pid-shard`` user runs next. ``str()`` is the CLI's wording; a Dagster
    step uses ``worded`` with its own advice (re-execute, materialize)."""

    facts: str
    cli_advice: str

    def worded(self, advice: str) -> str:
        return f"{self.facts}: {advice}; nothing was published"

    def __str__(self) -> str:
        return self.worded(self.cli_advice)


class TasksUnfinishedError(BuildError):
    """The commit found write tasks without a completion record (or with damaged shards)."""


@dataclass
class TaskOutcome:
    stage: str
    index: int
    of: int
    record: str  # where its completion record is (a path, or an s3:// URL)
    already_done: bool  # the record was there: nothing was read or written
    items: int = 0  # samples (intake) or shards (write) in the task's slice
    first: int = 0  # position of its first shard (write; an intake slice is not contiguous)
    done: int = 0  # files validated (intake) or shards written (write)
    reused: int = 0  # outcomes reused (intake) or shards kept / hard-linked (write)
    nothing_staged: bool = False  # no plan staged, over a committed build: the plan found it up to date
    copied: int = 0  # tars an s3 write task copied inside the bucket from the current version
    repaired: int = 0  # tars of the served version an s3 write task found missing or damaged and sent again
    nbytes: int = 0  # bytes of the intake slice's files


@dataclass
class PlanOutcome:
    out: Path
    report: IntakeReport
    shards: int
    samples: int
    up_to_date: bool  # the committed build is what this one would publish: nothing staged
    files_validated: int = 0
    outcomes_reused: int = 0
    buckets: dict[str, int] = field(default_factory=dict)  # bucket -> shards
    damaged_shards: int = 0  # with ``repair``: committed shards whose tars were missing or damaged
    version: str | None = None  # an s3 output's: the version staged in the bucket (None: nothing staged)


# In a write record: the plan it wrote shards of (``plan_files.shards_identity``).
PLAN_ID = "plan_shards_sha256"


# A write record's per-shard fields (``staging.coverage`` reads them) -> the key of each shard's
# entry (``write.shard_record``).
SHARD_FIELDS = {"digests": "tars", "key_index_bytes": "key_index_bytes", "tar_sizes": "bytes"}


def shard_entries(r: dict, start: int, stop: int) -> dict[int, tuple]:
    """Each shard's entry of write record ``r``: (digests, key index size (None: left to a later
    step, any size), tar sizes, ETags, check findings); KeyError, TypeError or ValueError when
    one is lacking or malformed."""
    def entry(k: str) -> tuple:
        kib = r["key_index_bytes"][k]
        return (dict(r["digests"][k]), None if kib is None else int(kib), dict(r["tar_sizes"][k]),
                dict(r.get("etags", {}).get(k) or {}), dict(r.get("problems", {}).get(k, {})))

    return {i: entry(str(i)) for i in range(start, stop)}


def is_write_record_of(rec: dict, identity: dict) -> bool:
    """Whether ``rec`` is a write record of the plan ``identity`` names (a folder's ``PLAN_ID``,
    a bucket's ``plan_sha256``) with every per-shard field and an entry for each of its shards.
    One of an older pid-shard, without the tar digests and sizes the commit takes its checksums
    from, or one lacking a shard's entry, is not: its task runs again, and until then its shards
    are unfinished (the write task and the commit ask this one question)."""
    if not (all(f in rec for f in SHARD_FIELDS) and all(rec.get(k) == v for k, v in identity.items())):
        return False
    try:
        shard_entries(rec, *rec["shards"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def check_task(index: int, of: int) -> None:
    slice_bounds(0, index, of)  # raises ValueError naming the range


def spans_text(positions: list[int]) -> str:
    # Along a run of consecutive positions, position minus place stays the same.
    runs = [[p for _i, p in run] for _d, run in groupby(enumerate(positions), lambda ip: ip[1] - ip[0])]
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def unfinished_write(shards: int, ofs: set[int], missing: list[int], where: str, *,
                     damaged: bool = False) -> Unfinished | None:
    """Why a staged plan of ``shards`` shards cannot be committed (None: no shard is ``missing``),
    for a folder and a bucket alike: ``ofs``, the ``--of`` of each of its write records found in
    ``where``; ``damaged``, some record's shards had gone missing or been damaged since."""
    if not missing:
        return None
    if len(ofs) == 1:
        n, gone = next(iter(ofs)), set(missing)
        left = [i for i in range(n) if any(j in gone for j in range(*slice_bounds(shards, i, n)))]
        return Unfinished(
            f"write task{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} of {n} "
            f"{'have' if len(left) > 1 else 'has'} not finished (no completion record in {where}"
            f"{'; some had a shard missing or damaged since, and must run again' if damaged else ''})",
            f"run `pid-shard task --index I --of {n}` for each, then commit again")
    if not ofs:
        return Unfinished(f"no write task has finished for the staged plan ({shards} shards; no completion record "
                          f"in {where})", "run `pid-shard task --index I --of N` for I = 0 .. N-1, then commit again")
    return Unfinished(
        f"shards {spans_text(missing)} of {shards} lie in no finished write task (records for --of "
        f"{', '.join(map(str, sorted(ofs)))} in {where})",
        "run `pid-shard task --index I --of N` for each unfinished I of one N, then commit again")


def report_of(folder: Path) -> IntakeReport:
    """The intake report a plan staged in ``folder`` (``intake_report.json``), for the commit's summary."""
    doc = load_state_doc((state_dir(folder) / REPORT).read_bytes(), state_dir(folder) / REPORT)
    return IntakeReport(
        doc["source"], modalities=list(doc["modalities"]), empty_modalities=list(doc["empty_modalities"]),
        image_modality=doc["image_modality"], files_seen=dict(doc["files_seen"]), orphans=dict(doc["orphans"]),
        skipped_files=Counter(doc["skipped_files"]), dropped=Counter(doc["dropped"]),
        examples={k: list(v) for k, v in doc["examples"].items()}, key_collisions=doc["key_collisions"],
        samples=doc["samples"],
    )


def validate_of(folder: Path) -> str:
    return (load_intake_settings(folder) or {}).get("validate", VALIDATE_FULL)
