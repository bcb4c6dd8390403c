"""An ``s3://bucket/prefix`` output: its versions, the pointer, and what a build's stages use of them.

A build of such an output is the plan, write tasks and commit of ``sharding/tasks/``, which
publish a version this way (``loader/formats/version_pointer.py`` has the layout):

1. the tars and key indexes go under ``versions/<id>/`` (``<id>`` is a digest of the plan
   (``version_id``), so the same build is the same version and a killed upload resumes
   where it stopped: objects already there with the right size are kept; a tar the current
   version already holds with the same checksum is copied inside the bucket, not uploaded);
2. then the manifests and the settings the version was cut with;
3. then one listing checks every object of the version against what was staged (sizes, the
   tars' as their manifests list them): a bucket emptied or deleted meanwhile fails the build;
4. then ``pid-current.json`` is replaced in one conditional PUT (``If-Match`` the ETag the
   build read at its start, ``If-None-Match: *`` for a first pointer): the commit point. Until
   then readers keep the previous version; a build killed before it changed nothing they see,
   and a build whose pointer moved meanwhile (another build won) fails naming the winner.

From before step 1's listing until after step 4 the build holds a claim on its version
(``claims.py``). The version the pointer moves away from is recorded as retired, with the time;
only ``cleanup_versions`` (the ``s3_version_cleanup`` job) deletes versions, once retired longer
than a grace period, and abandoned uploads (no pointer ever named them) once older than it;
never the version the pointer names when the deletion starts, nor one a build has claimed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from loader.formats.errors import FormatError
from loader.formats.twin_tar import tar_path
from loader.formats.version_pointer import (
    POINTER_NAME,
    VERSIONS_DIR,
    VersionPointer,
    parse_pointer,
    sibling_version,
    version_dir,
)
from loader.formats.wdinfo import check_wdinfo
from loader.io import urls
from loader.io.errors import ObjectNotFoundError, PreconditionFailedError
from loader.io.objects import S3Objects
from loader.io.s3_client import S3AccessError, S3Settings
from pid_platform.sharding.commit.claims import (
    DEFAULT_TTL_S,
    DELETE,
    PUBLISH,
    HeldClaim,
    claims_on,
    remove_expired,
    wait_until_unclaimed,
)
from pid_platform.sharding.errors import BuildError, OutputNotWritableError
from pid_platform.sharding.layout import PROBE_PREFIX, STATE_DIR
from pid_platform.sharding.pause_points import pause_point
from pid_platform.sharding.state_doc import load_state_doc

log = logging.getLogger(__name__)
WORK_ROOT_ENV = "PID_WORK_ROOT"
DEFAULT_GRACE_S = 24 * 3600.0
# Build state a version carries: the settings it was cut with, and its intake (samples, report,
# validation level, every file's outcome), so any machine re-shards it, validates only the files
# changed since and finds a rebuild up to date from the bucket alone (``sharding/tasks/``); and
# its plan, so a plan on any machine extends it when only modality folders were added.
CARRIED_STATE = ("sharding.json", "samples.parquet", "intake_report.json", "intake.json", "intake_cache.parquet",
                 "plan.parquet", "plan_cut.json")


def is_s3_url(location: str | os.PathLike[str]) -> bool:
    return isinstance(location, str) and urls.is_s3(location)


def refuse_other_urls(location: str, what: str) -> None:
    """A string that looks like a URL is never a local path: refuse every scheme but s3://."""
    if not (urls.is_local(location) or urls.is_s3(location)):
        raise ValueError(f"{what} {location!r}: use a local folder or s3://bucket/prefix "
                         f"({urls.scheme(location)}:// is not a place builds are written to)")


@dataclass(frozen=True)
class S3Output:
    """One output on S3 (a source's, or the output root holding them); ``settings`` say how
    to reach it, credentials come from boto3's usual chain."""

    url: str
    settings: S3Settings = field(default_factory=lambda: S3Settings(max_attempts=5))

    def __post_init__(self) -> None:
        bucket, _ = urls.split_s3(self.url)  # ValueError for anything but s3://bucket[/prefix]
        if any(c in bucket for c in "@?#") or bucket != bucket.lower():
            raise ValueError(f"{self.url!r}: not an s3://bucket/prefix URL (credentials go in the environment)")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @property
    def bucket(self) -> str:
        return urls.split_s3(self.url)[0]

    @property
    def prefix(self) -> str:
        return urls.split_s3(self.url)[1]

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def child(self, name: str) -> S3Output:
        return replace(self, url=f"{self.url}/{name}")

    def store(self) -> S3Objects:
        """The bucket, through the storage layer: keys are whole (``self.key(...)``)."""
        return S3Objects(f"s3://{self.bucket}", self.settings)

    def __str__(self) -> str:
        return self.url


def default_work_root() -> Path:
    return Path(os.environ.get(WORK_ROOT_ENV) or Path.home() / ".cache" / "pid-platform" / "work")


def work_dir(output: S3Output, work_root: str | os.PathLike[str] | None = None) -> Path:
    """The local folder a build of ``output`` stages in (and keeps, to reuse unchanged tars)."""
    return Path(work_root or default_work_root()).resolve() / output.bucket / (output.prefix or "_root")


def check_writable(output: S3Output) -> None:
    """Prove, before any work, that ``output``'s bucket exists and takes a write: an unreachable
    endpoint, a missing bucket and refused credentials each stop here with what to fix."""
    store = output.store()
    probe = output.key(f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        # First, and on its own: some servers (SeaweedFS) create a bucket on a first PUT.
        store.check_bucket()
        store.put(probe, b"")
        store.delete(probe)
    except S3AccessError as exc:
        raise OutputNotWritableError(f"writing to {output}: {exc} (nothing was built or published)") from None


def get_bytes(output: S3Output, rel: str) -> bytes | None:
    """The object at ``output/rel``, or ``None`` when there is none."""
    try:
        return output.store().get_or_none(output.key(rel))
    except S3AccessError as exc:
        raise BuildError(str(exc)) from None


def read_pointer(output: S3Output) -> VersionPointer | None:
    return read_pointer_tagged(output)[0]


def read_pointer_tagged(output: S3Output) -> tuple[VersionPointer | None, str | None]:
    """The pointer and its ETag (what a conditional switch from it must match), or ``(None, None)``."""
    try:
        data, etag = output.store().get_tagged(output.key(POINTER_NAME))
    except ObjectNotFoundError:
        return None, None
    except S3AccessError as exc:
        raise BuildError(str(exc)) from None
    try:
        return parse_pointer(data, f"{output}/{POINTER_NAME}"), etag
    except FormatError as exc:
        raise BuildError(f"{exc}; delete it to publish a fresh version (readers then see none until the build "
                         "commits)") from None


def object_sha256(output: S3Output, rel: str) -> str | None:
    """The sha256 of the object at ``output/rel`` (read whole, in chunks), or ``None`` if absent."""
    try:
        with output.store().open(output.key(rel)) as body:
            return hashlib.file_digest(body, "sha256").hexdigest()
    except ObjectNotFoundError:
        return None


def list_sizes(output: S3Output, rel_prefix: str) -> dict[str, int]:
    """Object sizes under ``output/rel_prefix/``, keyed by path relative to that prefix."""
    prefix = output.key(rel_prefix) + "/"
    return {obj.key[len(prefix):]: obj.size for obj in output.store().list(prefix)}


class PublishRaceError(BuildError):
    """Another build (or a person) moved the pointer while this build ran: it published nothing."""


class VersionIncompleteError(BuildError):
    """The version's objects in the bucket are not those its manifests list: nothing was switched."""


@dataclass
class PublishedVersion:
    output: str
    version: str
    unchanged: bool = False  # the pointer already named this version

    @property
    def url(self) -> str:
        return f"{self.output}/{version_dir(self.version)}"


# What fixes every byte of a version before a tar is written: the plan (each sample's files,
# sizes and fingerprints, in shard order), the settings it was cut with, how its modalities were
# added (``plan/add_modality.py``) and the intake report (the source's name the manifests carry).
VERSION_INPUTS = ("plan.parquet", "sharding.json", "plan_cut.json", "intake_report.json")


def version_id(staging: Path) -> str:
    """A digest naming the version of the build staged in ``staging``, from its plan: known
    before any tar is written, so write tasks on other machines put their tars straight into
    ``versions/<id>/`` (``sharding/tasks/``). Same plan, same id, same bytes."""
    h = hashlib.sha256(b"pid-version-2")
    for name in VERSION_INPUTS:
        path = staging / STATE_DIR / name
        h.update(f"\0{name}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest() if path.is_file() else b"-")
    return h.hexdigest()[:20]


def checksums_of(manifests: dict[str, bytes]) -> dict[str, str]:
    """Path of each tar (relative to the version folder) -> its checksum, from a version's
    manifests (path -> bytes)."""
    found: dict[str, str] = {}
    for rel, data in manifests.items():
        cols = check_wdinfo(load_state_doc(data, rel), rel)
        manifest_dir = Path(rel.rpartition("/")[0] or ".")
        for m in cols.data_keys:
            for path, sha in zip(cols.data_list, cols.tar_sha256.get(m) or [], strict=False):
                if sha and (cols.root == "." or sibling_version(cols.root)):  # a sibling: the same paths there
                    found[os.path.normpath(tar_path(manifest_dir, "", m, path).as_posix())] = sha
    return found


def verify_before_switch(output: S3Output, version: str, expected: dict[str, int]) -> None:
    """Refuse the switch when an object of ``version`` is missing from the bucket or of another
    size than ``expected`` (one listing, nothing downloaded)."""
    try:
        there = list_sizes(output, version_dir(version))
    except S3AccessError as exc:
        raise VersionIncompleteError(f"{exc} (checking version {version} before the pointer switch: the bucket "
                                     "was deleted during the build?); the pointer was not changed") from None
    bad = [rel for rel, size in sorted(expected.items()) if there.get(rel) != size]
    if bad:
        raise VersionIncompleteError(
            f"{output}/{version_dir(version)}: {len(bad)} of its {len(expected)} objects are missing or of the "
            f"wrong size after the upload (e.g. {bad[0]}: {there.get(bad[0], 'missing')}, expected "
            f"{expected[bad[0]]} bytes): the bucket was emptied, deleted or changed during the build; the pointer "
            "was not changed, re-run the build to upload the version again")


def put_pointer(output: S3Output, pointer: VersionPointer, etag: str | None) -> bool:
    """Replace the pointer only if it is still the one with ``etag`` (``None``: only if there is
    none). False when it is not (a conditional write the server refused)."""
    store, key = output.store(), output.key(POINTER_NAME)
    try:
        if etag:
            store.put_if_match(key, pointer.to_bytes(), etag, content_type="application/json")
        else:
            store.put_if_absent(key, pointer.to_bytes(), content_type="application/json")
    except PreconditionFailedError:
        return False
    return True


def switch_pointer(output: S3Output, vid: str, manifests: list[str], started: VersionPointer | None,
            etag: str | None, holder: str, now: Callable[[], float], uses: list[str] | None = None) -> None:
    """Point ``output`` at ``vid``, conditional on the pointer being the one the build started
    from. A pointer that changed only in its ``retired`` record (the cleanup forgetting versions
    it deleted) still names the version the build started from: switch from it instead.
    ``uses``: the versions whose folders hold tars of ``vid`` (``in_place.py``); the versions the
    old one used and the new one does not are retired with it."""
    base = started
    uses = sorted(set(uses or ()))
    for _ in range(5):
        retired = dict(base.retired) if base else {}
        if base is not None:
            for old in {base.version, *base.uses} - {vid, *uses}:
                retired[old] = now()
        for v in (vid, *uses):
            retired.pop(v, None)  # a version published again (or used) is current, not retired
        if put_pointer(output, VersionPointer(vid, manifests, retired, built_by=holder, uses=uses), etag):
            return
        base, etag = read_pointer_tagged(output)
        if (base.version if base else None) != (started.version if started else None):
            raise _lost_race(output, base, started, vid)
    raise _lost_race(output, base, started, vid)


def _lost_race(output: S3Output, now_there: VersionPointer | None, started: VersionPointer | None,
               vid: str) -> PublishRaceError:
    if now_there is None:
        what = (f"{output}/{POINTER_NAME} vanished while this build ran (the bucket was emptied or deleted, or "
                "someone deleted the pointer)")
    else:
        what = (f"another build ({now_there.built_by or 'unnamed'}) moved {output}/{POINTER_NAME} to version "
                f"{now_there.version} while this one ran")
    start = f"version {started.version}" if started else "no version (a first publish)"
    return PublishRaceError(
        f"{what}; this build started from {start} and did not publish its version {vid} (its objects stay under "
        f"{output}/{version_dir(vid)}/ until the cleanup removes them); re-run it to publish on top of what is "
        "current now")


@contextmanager
def publish_claims(output: S3Output, vids: set[str], *, now: Callable[[], float] = time.time,
                   holder: str | None = None) -> Iterator[list[HeldClaim]]:
    """A publish claim (``claims.py``) on each version in ``vids`` for the block, taken before
    anything of theirs is listed or sent. A cleanup that claimed one first may be deleting it:
    this waits (saying so) until it is done, then lists what it left; one that claims after us
    sees our claim and leaves the version alone."""
    pause_point("publish:start")
    with ExitStack() as stack:
        held = [stack.enter_context(HeldClaim(output, vid, PUBLISH, holder=holder, now=now))
                for vid in sorted(vids)]
        for vid in sorted(vids):
            wait_until_unclaimed(output, vid, DELETE, now=now, on_wait=lambda c, vid=vid: log.warning(
                "%s: waiting for the %s (until it ends, or its claim expires at %s) before publishing version %s",
                output, c.describe(), time.strftime("%H:%M:%S", time.localtime(c.expires)), vid))
        pause_point("publish:claimed")
        yield held


def published_sources(output_root: S3Output) -> dict[str, VersionPointer]:
    """Each folder under an S3 output root that holds a pointer (a published source), with it."""
    prefix = output_root.key() + "/" if output_root.prefix else ""
    names = list(output_root.store().list_prefixes(prefix))
    found = {}
    for name in sorted(n for n in names if n and not n.startswith(".")):
        pointer = read_pointer(output_root.child(name))
        if pointer is not None:
            found[name] = pointer
    return found


def list_versions(output: S3Output) -> dict[str, float]:
    """Version id -> time of its newest object, for every version folder under ``output``."""
    prefix = output.key(VERSIONS_DIR) + "/"
    newest: dict[str, float] = {}
    for obj in output.store().list(prefix):
        vid = obj.key[len(prefix):].split("/", 1)[0]
        newest[vid] = max(newest.get(vid, 0.0), obj.modified)
    return newest


@dataclass
class Cleanup:
    current: str | None
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # not current, still within the grace period
    claimed: list[str] = field(default_factory=list)  # past it, but a build is publishing them
    objects_deleted: int = 0
    claims_expired: int = 0  # claims of processes that died holding them, deleted


def cleanup_versions(output: S3Output, *, grace_s: float = DEFAULT_GRACE_S,
                     now: Callable[[], float] = time.time, holder: str | None = None,
                     claim_ttl_s: float = DEFAULT_TTL_S) -> Cleanup:
    """Delete the versions of ``output`` no reader should still use: retired longer than
    ``grace_s`` ago, or never made current and untouched for ``grace_s`` (an abandoned upload).

    Never deleted: the version the pointer names when its deletion starts, and one a build has
    claimed. Each deletion claims the version first, then reads the build claims and the
    pointer again (``claims.py`` says why that order closes the race with a build).
    ``claim_ttl_s``: how long a cleanup killed while deleting a version holds up a build
    republishing it.
    """
    pointer = read_pointer(output)
    report = Cleanup(pointer.version if pointer else None)
    t = now()
    retired = dict(pointer.retired) if pointer else {}
    found = list_versions(output)
    pause_point("cleanup:listed")
    for vid, newest in sorted(found.items()):
        if pointer is not None and (vid == pointer.version or vid in pointer.uses):
            continue
        if t - retired.get(vid, newest) < grace_s:
            report.kept.append(vid)
            continue
        with HeldClaim(output, vid, DELETE, holder=holder, now=now, ttl_s=claim_ttl_s) as claim:
            pause_point("cleanup:claimed")
            if any(c.purpose == PUBLISH and c.live(now()) for c in claims_on(output, vid)):
                report.claimed.append(vid)
                continue
            fresh = read_pointer(output)
            if fresh is not None and (fresh.version == vid or vid in fresh.uses):
                report.kept.append(vid)  # republished since the first read: current now
                continue
            if fresh is not None and vid in fresh.retired and t - fresh.retired[vid] < grace_s:
                report.kept.append(vid)  # current and retired again since the first read
                continue
            claim.check()
            pause_point("cleanup:deleting")
            report.objects_deleted += delete_prefix(output, version_dir(vid))
            report.removed.append(vid)
    _forget_removed(output, report.removed)
    report.claims_expired = remove_expired(output, now=now)
    return report


def _forget_removed(output: S3Output, removed: list[str]) -> None:
    """Drop deleted versions from the pointer's ``retired`` record, unless the pointer changed."""
    pointer, etag = read_pointer_tagged(output)
    if pointer is None or not any(v in pointer.retired for v in removed):
        return
    left = {v: s for v, s in pointer.retired.items() if v not in removed}
    put_pointer(output, replace(pointer, retired=left), etag)  # refused: the next cleanup forgets them


def delete_prefix(output: S3Output, rel_prefix: str) -> int:
    """Delete every object under ``output/rel_prefix/`` (listed whole first); returns how many."""
    store = output.store()
    return store.delete_many([o.key for o in store.list(output.key(rel_prefix) + "/")])
