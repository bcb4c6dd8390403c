"""Where the stages of a build meet: the staging folder beside a folder output
(``versions.staging_dir``), or ``<output>/.pid-build/staged/`` of an ``s3://`` output, each
task on its own machine working in a scratch folder of its own (``scratch_dir``).

For a bucket, what one task hands the next goes through it (``docs/formats.md`` section 9b):

* ``staged/intake/<file>`` and ``staged/intake.json``: the samples an intake staged (the
  Dagster ``sample_set`` step), for a plan on another machine;
* ``staged/state/<file>`` and, last, ``staged/staged.json``: the plan (``Staged``);
* ``staged/tasks/``: task records (intake parts, write records with every shard's digests);
* ``staged/shards/<bucket>/<index>.json``: one marker per shard a write task has sent.

Each set of files is named, with each file's sha256, by one small document written after the
files and deleted before them, so a reader never takes a half-replaced set for a whole one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from loader.formats.strict_doc import Fields
from loader.formats.twin_tar import file_sha256, key_index_relpath, tar_path
from loader.io.errors import ObjectNotFoundError, PreconditionFailedError
from loader.io.s3_client import S3AccessError
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.s3_output import (
    VERSION_INPUTS,
    S3Output,
)
from pid_platform.sharding.commit.state import (
    FINGERPRINT,
    INTAKE_SETTINGS,
    REPORT,
    SAMPLES,
    state_dir,
)
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.cache import CACHE_NAME
from pid_platform.sharding.intake.task import slice_bounds
from pid_platform.sharding.layout import bucket_dir, final_dir
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.columnar import Shard
from pid_platform.sharding.plan.plan_files import (
    PLAN,
    SHARDS,
    PlanSource,
)
from pid_platform.sharding.state_doc import load_state_doc
from pid_platform.sharding.tasks.outcomes import TaskOrderError, shard_entries
from pid_platform.sharding.tasks.records import STAGED, bucket_staging, get_doc

STAGED_NAME = "staged.json"
STAGING_NAME = "staging.json"  # a plan began staging (``stage_plan_state``)
# Held (PID_PAUSE_AT) once the plan's state files are staged, before staged.json: tests kill it there.
STAGING_POINT = "s3-plan:state-staged"
INTAKE_NAME = "intake.json"
STAGED_FORMAT = 1
# staged.json's own format: 2 adds the pointer the plan saw and the staged plan's ETag.
STAGED_PLAN_FORMAT = 2
# A version id as ``s3_output.version_id`` and ``in_place.InPlace.version_id`` make them (hex):
# staged.json is read from the bucket, and a version id becomes a folder name.
VERSION_ID = re.compile(r"[0-9a-f]{8,64}")
SHA256 = re.compile(r"[0-9a-f]{64}")
# What an intake leaves beside a build: a plan on another machine cuts the samples from it.
INTAKE_STATE = (SAMPLES, REPORT, INTAKE_SETTINGS, CACHE_NAME, FINGERPRINT)
# What the commit carries into the version (``s3_output.CARRIED_STATE``) or reports, beside the plan.
# shards.parquet is not carried: a commit reads the staged one, a later plan only the committed plan.
SHARED_STATE = tuple(dict.fromkeys((*VERSION_INPUTS, *INTAKE_STATE, SHARDS)))
# The plan's state as a published version carries it (a later plan extends it).
PLAN_STATE = ("plan.parquet", "sharding.json", "plan_cut.json")
# The state files a version carries that the commit copies inside the bucket rather than through
# its machine: the big ones (each about 1 GB at 10 M samples), which it does not read.
COPIED_STATE = (SAMPLES, PLAN, CACHE_NAME)
# What a write task and the steps after it pull of the staged plan: all but plan.parquet itself,
# which they read by ranges (``staged_plan``).
TASK_STATE = ("sharding.json", "plan_cut.json", SHARDS)


class StagedStateError(BuildError):
    """A staged file is missing or is not the one its set names (a new plan or intake replaced it)."""


@dataclass(frozen=True)
class SeenPointer:
    """The pointer a plan was cut against: the commit switches only from it (``None`` version:
    no version was published; ``etag`` as the bucket gave it)."""

    version: str | None
    etag: str | None


@dataclass(frozen=True)
class Staged:
    """What ``staged.json`` says: the version the staged plan builds, its state files (each
    with its sha256), the staged plan.parquet's ETag (the write tasks read it by ranges, each
    pinned to it) and the pointer the plan saw."""

    version: str
    plan_sha256: str
    source: str
    state: dict[str, str]  # state file -> sha256
    # A version that only adds modalities (``commit/in_place.py``): the version whose folder holds
    # the current tars, where the added modalities' tars go too, and the modalities whose tars
    # are left there untouched. None: every object goes into ``versions/<version>/``.
    base: str | None = None
    reused: tuple[str, ...] = ()
    pointer: SeenPointer = SeenPointer(None, None)
    plan_etag: str | None = None

    def to_bytes(self) -> bytes:
        doc = {"format": STAGED_PLAN_FORMAT, "version": self.version, "plan_sha256": self.plan_sha256,
               "source": self.source, "state": self.state, "plan_etag": self.plan_etag,
               "pointer": {"version": self.pointer.version, "etag": self.pointer.etag}}
        if self.base is not None:
            doc["in_place"] = {"base": self.base, "reused": list(self.reused)}
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    def home(self, tar: bool) -> str:
        """The version whose folder holds this version's tars (``tar``) or other objects."""
        return self.base if self.base is not None and tar else self.version


def rel(*parts: str) -> str:
    """A path under the staged build, relative to the output."""
    return "/".join((STAGED, *parts))


def shard_marker(plan: Shard) -> str:
    """The staged marker of a shard a write task has sent (a ``bucket_staging`` name)."""
    return f"shards/{plan.bucket or '_flat'}/{plan.index:06d}.json"


def push_files(output: S3Output, folder: Path, names: tuple[str, ...], under: str, what: str) -> dict[str, str]:
    """``folder``'s files among ``names`` to ``staged/<under>/``; name -> sha256 of each sent."""
    sent = {n: file_sha256(folder / n) for n in names if (folder / n).is_file()}
    for n in sorted(sent):
        bucket_staging(output).put(f"{under}/{n}", folder / n, what)
    return sent


def pull_files(output: S3Output, files: dict[str, str], under: str, folder: Path, named_by: str) -> None:
    """``staged/<under>/<name>`` into ``folder`` for each of ``files`` (name -> sha256) that
    ``folder`` does not already hold with that sha256, each checked against it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, sha in sorted(files.items()):
        path = folder / name
        if path.is_file() and file_sha256(path) == sha:
            continue
        data = bucket_staging(output).get(f"{under}/{name}")
        if data is None or hashlib.sha256(data).hexdigest() != sha:
            raise StagedStateError(
                f"{output}/{rel(under, name)}: missing, or not the file {output}/{rel(named_by)} names (another "
                "build of this output is staging anew?); run the build (or `pid-shard plan`) again")
        path.write_bytes(data)


def parse_staged(data: bytes, where: str) -> Staged:
    """``staged.json`` read from ``where``; ``StagedStateError`` naming the file for anything
    that is not a whole document of this format (every field is checked: the write tasks and the
    commit act on it; a version id becomes a folder name)."""
    fix = "run `pid-shard plan` (the same --input-dir, --output-dir and settings) again"
    f = Fields(load_state_doc(data, where, fix), where, what="a staged plan", fix=fix, error=StagedStateError,
               version=("format", STAGED_PLAN_FORMAT))
    state = f.inner("state")
    if PLAN not in state.doc:
        raise f.refuse("state", state.doc, "names no plan.parquet")
    sha = {n: state.text(n, pattern=SHA256, kind="a sha256") for n in state.doc}
    if f.text("plan_sha256", pattern=SHA256, kind="a sha256") != sha[PLAN]:
        raise f.refuse("plan_sha256", f.doc["plan_sha256"], "not its plan.parquet's")
    pointer = f.inner("pointer", optional="pointer" in f.doc)  # null: no version was published
    in_place = f.inner("in_place", optional=True)
    if in_place is not None and not isinstance(in_place.doc.get("reused"), list):
        raise in_place.refuse("reused", in_place.doc.get("reused"), "not a list")
    base = None if in_place is None else in_place.text("base", pattern=VERSION_ID, kind="a version id")
    seen = SeenPointer(None, None) if pointer is None else SeenPointer(
        pointer.text("version", pattern=VERSION_ID, kind="a version id", optional=True),
        pointer.text("etag", None, cut=True, optional=True))
    return Staged(f.text("version", pattern=VERSION_ID, kind="a version id"), sha[PLAN],
                  f.text("source", None, cut=True), sha,
                  base, () if in_place is None else tuple(str(m) for m in in_place.doc["reused"]), seen,
                  f.text("plan_etag", None, cut=True, optional=True))


def read_staged(output: S3Output) -> Staged | None:
    """The staged plan; None when there is no ``staged.json``; ``StagedStateError`` when there is
    one but it is damaged, of another format or names what it must not."""
    data = s3_output.get_bytes(output, rel(STAGED_NAME))
    return None if data is None else parse_staged(data, f"{output}/{rel(STAGED_NAME)}")


def leftovers(output: S3Output) -> list[str]:
    """What lies under ``staged/`` (a few names): a plan or intake was staged there, or begun."""
    prefix = output.key(STAGED) + "/"
    return [o.key[len(prefix):] for o in islice(output.store().list(prefix), 3)]


def stage_plan_state(output: S3Output, folder: Path, source: str, seen: SeenPointer, version: str,
                     before_marker: Callable[[], None], *, base: str | None = None,
                     reused: tuple[str, ...] = ()) -> Staged:
    """The plan staged in ``folder`` (a local staging or committed folder) into the bucket, for
    the write tasks and the commit on other machines; ``staged.json`` last. ``seen``: the pointer
    the plan was cut against; ``version``: the one it builds. ``base`` and ``reused``: a version
    published in place (``Staged``). ``before_marker`` runs right before ``staged.json``
    is written (the lease check: a plan that lost its lease stages nothing a task would take)."""
    # First a mark that a plan is being staged (so a plan killed from here on leaves ``staged/``
    # not empty: the tasks refuse rather than find the output up to date), then the replaced
    # plan's staged.json goes, so no task takes the new files for it.
    store = bucket_staging(output)
    store.put(STAGING_NAME, json.dumps({"format": STAGED_FORMAT}).encode(), "staging the plan")
    store.delete(STAGED_NAME)
    state = push_files(output, state_dir(folder), SHARED_STATE, "state", "staging the plan")
    pause_point(STAGING_POINT)
    try:
        plan_etag = output.store().head(output.key(rel("state", PLAN))).etag
    except (ObjectNotFoundError, S3AccessError) as exc:
        raise StagedStateError(f"{exc} (staging the plan: the staged plan.parquet is gone; another build of this "
                               "output is staging anew?)") from None
    staged = Staged(version, state[PLAN], source, state, base, reused, seen, plan_etag)
    before_marker()
    store.put(STAGED_NAME, staged.to_bytes(), "staging the plan")
    return staged


def pull_plan_state(output: S3Output, staged: Staged, folder: Path, names: tuple[str, ...] | None = None, *,
                    skip: tuple[str, ...] = ()) -> Path:
    """The staged plan's state files (those among ``names``, but not ``skip``) into ``folder``'s state folder."""
    files = {n: sha for n, sha in staged.state.items() if (names is None or n in names) and n not in skip}
    pull_files(output, files, "state", state_dir(folder), STAGED_NAME)
    return folder


@contextmanager
def staged_plan(output: S3Output, staged: Staged, folder: Path) -> Iterator[PlanSource]:
    """The staged plan.parquet for ``plan_files.load_shards`` / ``iter_shard_range``: the copy in
    ``folder``'s state when it was pulled with the rest; else, when the plan was staged with its
    shards.parquet, read from the bucket by ranges (its footer and the row groups asked for, each
    range pinned to the object's ETag); else (staged before shards.parquet existed) pulled whole.
    Rows that are not the staged plan's (staged anew meanwhile) are a ``StagedStateError``."""
    local = state_dir(folder) / PLAN
    if not local.is_file() and SHARDS not in staged.state:
        pull_plan_state(output, staged, folder, (PLAN,))
    what = f"{output}/{rel('state', PLAN)}"
    if local.is_file():
        try:
            yield local
        except ValueError as exc:  # rows that are not the plan's shards (``plan_files._checked``)
            raise _not_the_plan(output, what, exc) from None
        return
    # Only the plan's own reads are translated: an error of the caller's work (a tar missing
    # from the bucket) is its own, never "the plan was staged anew".
    try:
        ranged = output.store().open_ranged(output.key(rel("state", PLAN)))
    except ObjectNotFoundError as exc:
        raise _not_the_plan(output, what, exc) from None
    except S3AccessError as exc:
        raise BuildError(f"{exc} (reading the staged plan {what})") from None
    if staged.plan_etag is None or ranged.etag != staged.plan_etag:
        raise _not_the_plan(output, what, f"its ETag is {ranged.etag}, {rel(STAGED_NAME)} names {staged.plan_etag}")
    with ranged:
        try:
            yield _PlanReads(ranged, output, what)
        except ValueError as exc:
            raise _not_the_plan(output, what, exc) from None


def _not_the_plan(output: S3Output, what: str, why: object) -> StagedStateError:
    return StagedStateError(f"{what}: not the plan {output}/{rel(STAGED_NAME)} names ({why}); changed after the plan, "
                            "or another build of this output is staging anew? run `pid-shard plan` again")


class _PlanReads:
    """The staged plan's ranged reads, their failures said as what they mean."""

    def __init__(self, ranged: Any, output: S3Output, what: str) -> None:
        self._ranged, self._output, self._what = ranged, output, what
        self.name = what

    def __getattr__(self, attr: str) -> Any:
        target = getattr(self._ranged, attr)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return target(*args, **kwargs)
            except (ObjectNotFoundError, PreconditionFailedError) as exc:
                raise _not_the_plan(self._output, self._what, exc) from None
            except S3AccessError as exc:
                raise BuildError(f"{exc} (reading the staged plan {self._what})") from None
        return call


def push_intake(output: S3Output, staging: Path) -> None:
    """The samples an intake staged in ``staging`` (its ``INTAKE_STATE``), for a plan on another
    machine; any plan staged before is stale now and goes first."""
    store = bucket_staging(output)
    store.delete(STAGED_NAME, INTAKE_NAME)
    sent = push_files(output, state_dir(staging), INTAKE_STATE, "intake", "staging the intake")
    store.put(INTAKE_NAME, json.dumps({"format": STAGED_FORMAT, "files": sent}, sort_keys=True).encode(),
        "staging the intake")


def pull_staged_intake(output: S3Output, work: Path) -> bool:
    """The samples ``sample_set`` staged in the bucket (``push_intake``), into this machine's
    staging of the build (so the Dagster ``plan`` step cuts them wherever it runs); False when
    none are staged."""
    doc = get_doc(bucket_staging(output), INTAKE_NAME)
    if doc is None or doc.get("format") != STAGED_FORMAT or not isinstance(doc.get("files"), dict):
        return False
    pull_files(output, dict(doc["files"]), "intake", state_dir(versions.begin(work, first_step=True)), INTAKE_NAME)
    return True


@dataclass
class Coverage:
    """Per shard position, from the write records whose range is theirs."""

    digests: dict[int, dict[str, str]]  # tar sha256 per modality
    key_index_bytes: dict[int, int | None]
    tar_bytes: dict[int, dict[str, int]]  # tar size per modality
    etags: dict[int, dict[str, str]]  # the ETag each tar the task sent got at its put
    record: dict[int, str]  # the record that covers the shard (where it was read)
    written: set[int]  # written by the task (not kept from an earlier run)
    problems: dict[int, dict[str, list[str]]]  # check name -> problems the task found in its tars
    missing: list[int]  # shards no record covers
    ofs: set[int]  # the ``--of`` of the records that cover shards


def coverage(plans: Sequence[Shard], recs: list[dict]) -> Coverage:
    cov = Coverage({}, {}, {}, {}, {}, set(), {}, [], set())
    for r in recs:
        try:
            start, stop = slice_bounds(len(plans), r["index"], r["of"])
            if r.get("shards") != [start, stop]:
                continue
            # Read whole before any of it counts: a record lacking one shard's entry covers none.
            entries, written, of = shard_entries(r, start, stop), {int(i) for i in r.get("written", [])}, int(r["of"])
        except (KeyError, TypeError, ValueError):
            continue
        for i, (digests, kib, sizes, etags, problems) in entries.items():
            cov.digests[i], cov.key_index_bytes[i], cov.tar_bytes[i] = digests, kib, sizes
            cov.etags[i], cov.problems[i], cov.record[i] = etags, problems, str(r.get("path"))
        cov.written |= written
        cov.ofs.add(of)
    cov.missing = [i for i in range(len(plans)) if i not in cov.digests]
    return cov


def staged_folder_plan(out: Path, what: str) -> tuple[Path, Path] | None:
    """(staging folder, its plan) ; None when nothing is staged over a committed build."""
    staged = versions.staging_dir(out)
    plan = state_dir(staged) / PLAN
    if plan.is_file():
        return staged, plan
    if (state_dir(final_dir(out)) / SAMPLES).is_file() and not staged.exists():
        return None
    raise TaskOrderError(f"{what} of {out}: no plan is staged in {staged}",
                         "run `pid-shard plan` (the same --input-dir, --output-dir and settings) first")


def scratch_dir(output: S3Output, work_root: str | Path | None, name: str) -> Path:
    """A folder of this machine's own for one task (beside the one-process build's work folder)."""
    return beside(s3_output.work_dir(output, work_root), name)


def beside(work: Path, name: str) -> Path:
    return work.parent / f"{work.name}.tasks" / name


def staged_or_refuse(output: S3Output, what: str) -> Staged | None:
    """The staged plan; None when nothing is staged over a published version (the plan found it
    up to date and left ``staged/`` empty); a ``TaskOrderError`` when nothing was ever planned,
    or when ``staged/`` holds what a plan or intake began and no ``staged.json`` (a plan killed
    while staging, an intake staged since): the source changed, so never "up to date"."""
    staged = read_staged(output)  # a damaged staged.json: StagedStateError, naming it
    if staged is not None:
        return staged
    left = leftovers(output)
    if s3_output.read_pointer(output) is not None and not left:
        return None
    why = (f"{output}/{rel(STAGED_NAME)} is missing beside {', '.join(left)}{' ...' if len(left) > 2 else ''} "
           "(a plan was killed while staging, or an intake was staged since)") if left else (
        f"{output}/{rel(STAGED_NAME)} is missing")
    raise TaskOrderError(f"{what} of {output}: no plan is staged ({why})",
                         "run `pid-shard plan` (the same --input-dir, --output-dir and settings) first")


def tar_rel(plan: Shard, modality: str) -> str:
    return tar_path(Path(), plan.bucket, modality, plan.relpath).as_posix()


def key_index_rel(plan: Shard) -> str:
    return (bucket_dir(Path(), plan.bucket) / key_index_relpath(plan.relpath)).as_posix()


def shard_objects(plan: Shard, key_index_bytes: object) -> dict[str, int]:
    """Each object of ``plan``'s shard in its version folder -> its size."""
    found = {tar_rel(plan, m): plan.tar_bytes(m) for m in plan.modalities}
    found[key_index_rel(plan)] = key_index_bytes if isinstance(key_index_bytes, int) else -1
    return found


def shard_homes(staged: Staged | None, plan: Shard, key_index_bytes: object) -> dict[str, dict[str, int]]:
    """``shard_objects`` by the version whose folder holds them (``Staged.home``; a folder
    output's, ``staged`` None: its one staging folder, "")."""
    found: dict[str, dict[str, int]] = {}
    index = key_index_rel(plan)
    for r, n in shard_objects(plan, key_index_bytes).items():
        found.setdefault(staged.home(r != index) if staged is not None else "", {})[r] = n
    return found


def delete_staged(output: S3Output) -> None:
    bucket_staging(output).delete(STAGED_NAME, INTAKE_NAME)  # first: no task takes the rest
    s3_output.delete_prefix(output, STAGED)


