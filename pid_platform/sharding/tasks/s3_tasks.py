"""The build's tasks for an ``s3://`` output: they meet in the bucket, not in a shared folder.

Each task runs on any machine that reaches the source and the bucket, in a work folder of its
own (``PID_WORK_ROOT``) that nothing else reads; the staged build lives under
``<output>/.pid-build/staged/``:

* ``pid-shard plan``: the intake and the plan in this machine's work folder (as the one-process
  build: ``tasks.run.run_plan``, reusing what intake tasks uploaded), then the state the other
  tasks need (``SHARED_STATE``) under ``staged/state/`` and, last, ``staged/staged.json``
  naming the version (``s3_output.version_id``: a digest of the plan, known before any tar is
  written) and each state file's sha256.
* intake task ``I`` of ``N``: its slice's file outcomes as ``staged/tasks/intake-I-of-N.parquet``,
  then its record; the plan downloads every finished one.
* write task ``I`` of ``N``: shard range ``slice_bounds(shards, I, N)`` of the plan, one shard at
  a time: its tars are written into a scratch folder, hashed, sent to ``versions/<id>/``
  (copied inside the bucket instead when the current version holds the same bytes) with the
  key index, then a per-shard marker (``staged/shards/...``: the tars' sha256), and the scratch
  files are deleted: the task holds only the shard in flight. A killed task run again keeps
  every shard whose marker and objects are there; its record (``staged/tasks/write-I-of-N.json``,
  every shard's digests) comes last.
* ``pid-shard commit``: the manifests, from the plan and the records' digests (no tar is read),
  sent after every object is checked in one listing, then the pointer switch, as
  ``s3_output.publish_version`` does; then ``staged/`` is deleted.

The bytes of the version (its id included) are those of the one-process ``pid-shard`` build
of the same source and settings, whatever ``N`` and however many machines.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loader.formats.twin_tar import key_index_relpath, tar_path
from loader.formats.version_pointer import version_dir
from loader.io.s3_client import S3AccessError
from pid_platform.sharding import pipeline
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.claims import (
    DELETE,
    PUBLISH,
    HeldClaim,
    this_process,
    wait_until_unclaimed,
)
from pid_platform.sharding.commit.lease import build_lease, check_held
from pid_platform.sharding.commit.manifests import write_key_index_of, write_manifests
from pid_platform.sharding.commit.s3_output import (
    CARRIED_STATE,
    VERSION_INPUTS,
    PublishedVersion,
    S3Output,
)
from pid_platform.sharding.commit.state import (
    INTAKE_SETTINGS,
    REPORT,
    load_intake_settings,
    state_dir,
)
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL
from pid_platform.sharding.intake.task import slice_bounds
from pid_platform.sharding.layout import STATE_DIR, bucket_dir, final_dir
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.plan.add_modality import load_plan_cut
from pid_platform.sharding.plan.shard_plan import ShardingConfig, ShardPlan
from pid_platform.sharding.storage import SourceStore
from pid_platform.sharding.tasks import records as local_records
from pid_platform.sharding.tasks.records import INTAKE, RECORD_FORMAT, WRITE
from pid_platform.sharding.tasks.run import (
    SHARD_DONE_POINT,
    PlanOutcome,
    TaskOrderError,
    TaskOutcome,
    TasksUnfinishedError,
    report_from_json,
    run_intake_task,
    run_plan,
    shard_done_point,
    spans_text,
)
from pid_platform.sharding.write.tar_digests import tar_digests
from pid_platform.sharding.write.tars import ShardResult, shard_files, write_shards

STAGED = ".pid-build/staged"
STAGED_NAME = "staged.json"
STAGED_FORMAT = 1
# What the write tasks and the commit read of the plan's state (VERSION_INPUTS, and how the
# samples were validated, for the summary).
SHARED_STATE = (*VERSION_INPUTS, INTAKE_SETTINGS)


@dataclass(frozen=True)
class Staged:
    """What ``staged.json`` says: the version the staged plan builds, and its state files."""

    version: str
    plan_sha256: str
    source: str
    state: dict[str, str]  # state file -> sha256

    def to_bytes(self) -> bytes:
        return json.dumps({"format": STAGED_FORMAT, "version": self.version, "plan_sha256": self.plan_sha256,
                           "source": self.source, "state": self.state}, sort_keys=True, indent=1).encode()


def _rel(*parts: str) -> str:
    return "/".join((STAGED, *parts))


def _record_rel(stage: str, index: int, of: int) -> str:
    return _rel("tasks", local_records.record_path(Path(), stage, index, of).name)


def _shard_marker_rel(plan: ShardPlan) -> str:
    return _rel("shards", plan.bucket or "_flat", f"{plan.index:06d}.json")


def _get_json(output: S3Output, rel: str) -> dict | None:
    data = s3_output.get_bytes(output, rel)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _put(output: S3Output, rel: str, data: bytes | Path, what: str) -> None:
    try:
        output.store().put(output.key(rel), data)
    except S3AccessError as exc:
        raise BuildError(f"{exc} ({what}; nothing was published)") from None


def read_staged(output: S3Output) -> Staged | None:
    doc = _get_json(output, _rel(STAGED_NAME))
    if doc is None or doc.get("format") != STAGED_FORMAT:
        return None
    try:
        return Staged(str(doc["version"]), str(doc["plan_sha256"]), str(doc["source"]), dict(doc["state"]))
    except (KeyError, TypeError, ValueError):
        return None


def scratch_dir(output: S3Output, work_root: str | Path | None, name: str) -> Path:
    """A folder of this machine's own for one task (beside the one-process build's work folder)."""
    work = s3_output.work_dir(output, work_root)
    return work.parent / f"{work.name}.tasks" / name


def _pull_state(output: S3Output, staged: Staged, folder: Path) -> Path:
    """The staged plan's state files into ``folder``'s state folder, each checked against its sha256."""
    state = state_dir(folder)
    state.mkdir(parents=True, exist_ok=True)
    for name, sha in sorted(staged.state.items()):
        path = state / name
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha:
            continue
        data = s3_output.get_bytes(output, _rel("state", name))
        if data is None or hashlib.sha256(data).hexdigest() != sha:
            raise TaskOrderError(
                f"{output}/{_rel('state', name)}: missing or not the file {output}/{_rel(STAGED_NAME)} names (another "
                "`pid-shard plan` of this output is staging a new plan?); run `pid-shard plan` again, then the tasks")
        path.write_bytes(data)
    return folder


def _staged_or_refuse(output: S3Output, what: str) -> Staged | None:
    """The staged plan; None when nothing is staged over a published version (the plan found it
    up to date); a ``TaskOrderError`` when nothing was ever planned."""
    staged = read_staged(output)
    if staged is not None:
        return staged
    if s3_output.read_pointer(output) is not None:
        return None
    raise TaskOrderError(f"{what} of {output}: no plan is staged ({output}/{_rel(STAGED_NAME)} is missing); run "
                         "`pid-shard plan` (the same --input-dir, --output-dir and settings) first")


def run_s3_intake_task(
    store: SourceStore, source: str, output: S3Output, index: int, of: int, *, work_root: str | Path | None = None,
    trust_pickle: bool = False, num_workers: int = 1, validate: str = VALIDATE_FULL, revalidate: bool = False,
    force: bool = False,
) -> TaskOutcome:
    """Intake task ``index`` of ``of`` (``tasks.run.run_intake_task``) in a scratch folder of this
    machine; its outcomes and record then go to the bucket, where the plan finds them."""
    scratch = scratch_dir(output, work_root, f"intake-{index}-of-{of}")
    shutil.rmtree(scratch, ignore_errors=True)
    settings = {"validate": validate, "trust_pickle": trust_pickle}
    rel = _record_rel(INTAKE, index, of)
    rec = _get_json(output, rel)
    if rec is not None and rec.get("format") == RECORD_FORMAT and rec.get("settings") == settings:
        return TaskOutcome(INTAKE, index, of, Path(rel), True, rec.get("samples", 0), rec.get("first", 0))
    res = run_intake_task(store, source, scratch, index, of, trust_pickle=trust_pickle, num_workers=num_workers,
                          validate=validate, revalidate=revalidate, force=force)
    staged = versions.staging_dir(scratch)
    part = local_records.intake_part_path(staged, index, of)
    _put(output, _rel("tasks", part.name), part, f"intake task {index} of {of}")
    _put(output, rel, local_records.record_path(staged, INTAKE, index, of).read_bytes(),
         f"intake task {index} of {of}")
    shutil.rmtree(scratch, ignore_errors=True)
    return TaskOutcome(INTAKE, index, of, Path(rel), False, res.items, res.first, res.done, res.reused)


def _pull_intake_parts(output: S3Output, work: Path) -> None:
    """Every finished intake task's outcomes, beside this machine's staging of the build."""
    tasks = local_records.tasks_dir(versions.staging_dir(work))
    prefix = output.key(_rel("tasks")) + "/"
    names = {o.key[len(prefix):] for o in output.store().list(prefix)}
    for name in sorted(n for n in names if n.startswith(f"{INTAKE}-") and n.endswith(".json")):
        part = name[: -len(".json")] + ".parquet"
        data = s3_output.get_bytes(output, _rel("tasks", part)) if part in names else None
        if data is None:
            continue
        if not versions.staging_dir(work).exists():
            versions.begin(work, first_step=True)
        tasks.mkdir(parents=True, exist_ok=True)
        (tasks / part).write_bytes(data)


def run_s3_plan(
    store: SourceStore, source: str, output: S3Output, config: ShardingConfig, *, work_root: str | Path | None = None,
    trust_pickle: bool = False, num_workers: int = 1, force: bool = False, validate: str = VALIDATE_FULL,
    revalidate: bool = False,
) -> tuple[PlanOutcome, str | None]:
    """The plan, staged in the bucket; ``(outcome, version)``, version None when the pointer
    already names the version this plan builds (nothing staged: the tasks have nothing to do)."""
    work = s3_output.work_dir(output, work_root)
    with build_lease(output):
        _pull_intake_parts(output, work)
        plan = run_plan(store, source, work, config, trust_pickle=trust_pickle, num_workers=num_workers, force=force,
                        validate=validate, revalidate=revalidate)
        folder = final_dir(work) if plan.up_to_date else versions.staging_dir(work)
        vid = s3_output.version_id(folder)
        state = state_dir(folder)
        pointer = s3_output.read_pointer(output)
        if pointer is not None and pointer.version == vid and not pointer.uses:
            _delete_staged(output)
            return plan, None
        shared = {name: hashlib.sha256((state / name).read_bytes()).hexdigest()
                  for name in SHARED_STATE if (state / name).is_file()}
        # A staged plan being replaced: its marker goes first, so no task takes the new files for it.
        output.store().delete(output.key(_rel(STAGED_NAME)))
        for name in sorted(shared):
            _put(output, _rel("state", name), state / name, "staging the plan")
        staged = Staged(vid, shared[pipeline.PLAN], source, shared)
        _put(output, _rel(STAGED_NAME), staged.to_bytes(), "staging the plan")
        return plan, vid


class _CurrentTars:
    """The sha256 of each tar the current version lists: a write task copies one with the same
    bytes inside the bucket instead of uploading it."""

    def __init__(self, output: S3Output) -> None:
        pointer = s3_output.read_pointer(output)
        self.version = pointer.version if pointer is not None else None
        self.sha: dict[str, str] = {}
        if pointer is not None and not pointer.uses:
            docs = {m: s3_output.get_bytes(output, f"{pointer.version_dir()}/{m}") or b"{}" for m in pointer.manifests}
            try:
                self.sha = s3_output._checksums_of(docs)
            except ValueError:
                self.sha = {}  # an unreadable manifest only costs the copies


def run_s3_write_task(
    store: SourceStore, source: str, output: S3Output, index: int, of: int, *, work_root: str | Path | None = None,
    num_workers: int = 1, progress: Callable[[int, int], None] | None = None,
) -> TaskOutcome:
    """Write task ``index`` of ``of`` of the plan staged in the bucket: its shards' tars and key
    indexes into ``versions/<id>/``, shard by shard, then its record."""
    slice_bounds(0, index, of)  # raises ValueError naming the range
    rel = _record_rel(WRITE, index, of)
    staged = _staged_or_refuse(output, f"write task {index} of {of}")
    if staged is None:
        return TaskOutcome(WRITE, index, of, Path(rel), True, nothing_staged=True)
    rec = _get_json(output, rel)
    if rec is not None and rec.get("plan_sha256") == staged.plan_sha256:
        first, stop = rec["shards"]
        return TaskOutcome(WRITE, index, of, Path(rel), True, stop - first, first)
    scratch = _pull_state(output, staged, scratch_dir(output, work_root, f"write-{index}-of-{of}"))
    plans = pipeline.load_plans(scratch, pipeline.load_sharding_config(scratch))
    first, stop = slice_bounds(len(plans), index, of)
    mine = plans[first:stop]
    vdir = version_dir(staged.version)
    there = s3_output.list_sizes(output, vdir)
    current = _CurrentTars(output)
    bucket = output.store()
    counts: Counter[str] = Counter()
    digests: dict[int, dict[str, str]] = {}
    key_index_bytes: dict[int, int] = {}
    todo = []
    for i, plan in enumerate(mine, start=first):
        marker = _get_json(output, _shard_marker_rel(plan))
        if (marker is not None and marker.get("digest") == plan.digest() and all(
                there.get(r) == n for r, n in _objects_of(plan, marker.get("key_index_bytes")).items())):
            digests[i], key_index_bytes[i] = marker["tars"], marker["key_index_bytes"]
            counts["kept"] += 1  # sent by an earlier run of this task
        else:
            todo.append((i, plan))
    position = {id(p): i for i, p in todo}
    done = iter(range(len(mine) - len(todo) + 1, len(mine) + 1))

    def send(plan: ShardPlan, _result: ShardResult) -> None:
        i = position[id(plan)]
        shas = tar_digests(scratch, plan)
        write_key_index_of(scratch, plan)
        index_rel = (bucket_dir(Path(), plan.bucket) / key_index_relpath(plan.relpath)).as_posix()
        index_size = (scratch / index_rel).stat().st_size
        try:
            for m in plan.modalities:
                tar_rel = tar_path(Path(), plan.bucket, m, plan.relpath).as_posix()
                if current.sha.get(tar_rel) == shas[m]:
                    bucket.copy(output.key(version_dir(current.version), tar_rel), output.key(vdir, tar_rel))
                    counts["copied"] += 1
                else:
                    bucket.put(output.key(vdir, tar_rel), scratch / tar_rel)
                    counts["uploaded"] += 1
            bucket.put(output.key(vdir, index_rel), scratch / index_rel)
            # Last: the marker vouches for the shard's objects (a rerun keeps them).
            bucket.put(output.key(_shard_marker_rel(plan)), json.dumps(
                {"digest": plan.digest(), "tars": shas, "key_index_bytes": index_size}, sort_keys=True).encode())
        except S3AccessError as exc:
            raise BuildError(f"{exc} (write task {index} of {of}, shard {plan.relpath}; nothing was published)") from None
        digests[i], key_index_bytes[i] = shas, index_size
        for f in shard_files(scratch, plan):
            f.unlink(missing_ok=True)
        pause_point(SHARD_DONE_POINT)
        pause_point(shard_done_point(index, of))

    step = (lambda _res: progress(next(done), len(mine))) if progress else None
    write_shards(store, source, scratch, [p for _, p in todo], num_workers=num_workers, progress=step, then=send,
                 only_own_temp_files=True)
    # Last: the record says every shard of the range is in the bucket, with each tar's sha256.
    _put(output, rel, json.dumps({
        "format": RECORD_FORMAT, "stage": WRITE, "index": index, "of": of, "plan_sha256": staged.plan_sha256,
        "version": staged.version, "shards": [first, stop], "written": sorted(i for i, _ in todo),
        "digests": {str(i): d for i, d in sorted(digests.items())},
        "key_index_bytes": {str(i): n for i, n in sorted(key_index_bytes.items())},
    }, sort_keys=True, indent=1).encode(), f"write task {index} of {of}")
    shutil.rmtree(scratch, ignore_errors=True)
    return TaskOutcome(WRITE, index, of, Path(rel), False, len(mine), first, len(todo), counts["kept"],
                       copied=counts["copied"])


def _objects_of(plan: ShardPlan, key_index_bytes: object) -> dict[str, int]:
    """Each object of ``plan``'s shard in its version folder -> its size."""
    found = {tar_path(Path(), plan.bucket, m, plan.relpath).as_posix(): plan.tar_bytes(m) for m in plan.modalities}
    index_rel = (bucket_dir(Path(), plan.bucket) / key_index_relpath(plan.relpath)).as_posix()
    found[index_rel] = key_index_bytes if isinstance(key_index_bytes, int) else -1
    return found


def _write_records(output: S3Output, plan_sha256: str) -> list[dict]:
    prefix = output.key(_rel("tasks")) + "/"
    found = []
    for obj in output.store().list(prefix):
        name = obj.key[len(prefix):]
        if name.startswith(f"{WRITE}-") and name.endswith(".json"):
            doc = _get_json(output, _rel("tasks", name))
            if doc is not None and doc.get("format") == RECORD_FORMAT and doc.get("plan_sha256") == plan_sha256:
                found.append(doc)
    return found


def _covered(plans: list[ShardPlan], recs: list[dict]) -> tuple[dict[int, dict[str, str]], dict[int, int], list[int]]:
    """Each shard's tar digests and key index size from the records whose range is theirs;
    the shards no record covers."""
    digests: dict[int, dict[str, str]] = {}
    sizes: dict[int, int] = {}
    for r in recs:
        try:
            start, stop = slice_bounds(len(plans), r["index"], r["of"])
            if r.get("shards") != [start, stop]:
                continue
            for i in range(start, stop):
                digests[i], sizes[i] = dict(r["digests"][str(i)]), int(r["key_index_bytes"][str(i)])
        except (KeyError, TypeError, ValueError):
            continue
    return digests, sizes, [i for i in range(len(plans)) if i not in digests]


def run_s3_commit(output: S3Output, *, work_root: str | Path | None = None, num_workers: int = 1,
                  now: Callable[[], float] = time.time) -> pipeline.BuildSummary | None:
    """Commit the plan staged in the bucket once every write task's record is there: manifests,
    one listing that checks every object, the pointer switch; then ``staged/`` goes. None when
    nothing is staged over a published version (the plan found it up to date)."""
    with build_lease(output):
        staged = _staged_or_refuse(output, "commit")
        if staged is None:
            return None
        scratch = scratch_dir(output, work_root, "commit")
        shutil.rmtree(scratch, ignore_errors=True)
        _pull_state(output, staged, scratch)
        plans = pipeline.load_plans(scratch, pipeline.load_sharding_config(scratch))
        digests, index_sizes, missing = _covered(plans, _write_records(output, staged.plan_sha256))
        if missing:
            raise TasksUnfinishedError(
                f"commit of {output}: shards {spans_text(missing)} of {len(plans)} lie in no finished write task (no "
                f"completion record under {output}/{_rel('tasks')}/): run `pid-shard task --index I --of N` for "
                "each unfinished I of one N, then commit again; nothing was published")
        cut = load_plan_cut(scratch)
        position = {(p.bucket, p.index): i for i, p in enumerate(plans)}
        manifests = write_manifests(
            scratch, staged.source, plans, num_workers=num_workers,
            tar_sha256=lambda _out, p: digests[position[(p.bucket, p.index)]],
            plan_modalities=cut.plan_modalities if cut else None, key_index_present=lambda _path: True)
        expected: dict[str, int] = {}
        for i, p in enumerate(plans):
            expected.update(_objects_of(p, index_sizes[i]))
        manifest_rels = sorted(m.path.relative_to(scratch).as_posix() for m in manifests)
        state_rels = [f"{STATE_DIR}/{n}" for n in CARRIED_STATE if (scratch / STATE_DIR / n).is_file()]
        for r in manifest_rels + state_rels:
            expected[r] = (scratch / r).stat().st_size
        published = _publish(output, staged.version, scratch, manifest_rels, state_rels, expected, now)
        _delete_staged(output)
        report = report_from_json(json.loads((state_dir(scratch) / REPORT).read_bytes()))
        validate = (load_intake_settings(scratch) or {}).get("validate", VALIDATE_FULL)
        results = [ShardResult(p.bucket, p.index, p.relpath, len(p.samples), {m: p.tar_bytes(m) for m in p.modalities},
                               True) for p in plans]
        shutil.rmtree(scratch, ignore_errors=True)
        return pipeline.BuildSummary(staged.source, scratch, report, pipeline.summarize(results),
                                     [scratch / r for r in manifest_rels],
                                     [], validate, up_to_date=published.unchanged, published=published.url)


def _publish(output: S3Output, vid: str, folder: Path, manifest_rels: list[str], state_rels: list[str],
             expected: dict[str, int], now: Callable[[], float]) -> PublishedVersion:
    """The manifests and settings of version ``vid`` (whose tars the write tasks sent), then the
    check of every object and the conditional pointer switch (``s3_output.publish_version``'s end)."""
    current, etag = s3_output.read_pointer_tagged(output)
    result = PublishedVersion(str(output), vid, current.version if current else None)
    holder = this_process()
    check_held(output, vid)
    with HeldClaim(output, vid, PUBLISH, holder=holder, now=now) as claim:
        wait_until_unclaimed(output, vid, DELETE, now=now)
        for r in manifest_rels + state_rels:
            _put(output, f"{version_dir(vid)}/{r}", folder / r, "the commit")
            result.uploaded += 1
        pause_point("publish:before-verify")
        s3_output._verify_before_switch(output, vid, expected)
        if current is not None and current.version == vid and not current.uses:
            result.unchanged = True
            return result
        pause_point("publish:before-switch")
        claim.check()
        check_held(output, vid)
        s3_output._switch(output, vid, manifest_rels, current, etag, holder, now)
    return result


def _delete_staged(output: S3Output) -> None:
    store = output.store()
    prefix = output.key(STAGED) + "/"
    store.delete(output.key(_rel(STAGED_NAME)))  # first: no task takes what is left for a staged plan
    store.delete_many(o.key for o in store.list(prefix))


