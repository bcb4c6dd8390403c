"""What the stages read of the version an ``s3://`` output's pointer names: its manifests and the
objects they list (one listing per version folder), its settings, and the plan and intake state
it carries (``s3_output.CARRIED_STATE``), pulled into a machine's work folder so a plan there
extends the published plan, or validates only files changed since."""

from __future__ import annotations

import shutil
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes
from loader.formats.version_pointer import (
    POINTER_NAME,
    VersionPointer,
    sibling_version,
    version_dir,
)
from loader.formats.wdinfo import WdinfoManifest, parse_wdinfo
from pid_platform.sharding.commit import s3_output, versions
from pid_platform.sharding.commit.s3_output import S3Output
from pid_platform.sharding.commit.state import (
    FINGERPRINT,
    INTAKE_SETTINGS,
    REPORT,
    SAMPLES,
    state_dir,
)
from pid_platform.sharding.errors import BuildError
from pid_platform.sharding.intake.cache import CACHE_NAME
from pid_platform.sharding.layout import STATE_DIR
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.plan.shard_plan import ShardingConfig
from pid_platform.sharding.state_doc import load_state_doc
from pid_platform.sharding.tasks import staging


def pull_committed_plan(output: S3Output, folder: Path) -> Path | None:
    """The plan state the published version carries (``s3_output.CARRIED_STATE``) into
    ``folder``'s state folder, for ``plan/add_modality.plan_build`` on a machine that never held
    the build; None (nothing pulled) when no published version carries its plan."""
    shutil.rmtree(folder, ignore_errors=True)
    found = published_state(output, *staging.PLAN_STATE)
    if found.get("plan.parquet") is None or found.get("sharding.json") is None:
        return None
    _write_state(state_dir(folder), found)
    return folder


def _write_state(state: Path, found: dict[str, bytes | None]) -> None:
    """Each of ``found`` that the published version carries, into the state folder ``state``."""
    for name, data in found.items():
        if data is not None:
            atomic_write_bytes(state / name, data)


def current_manifests(output: S3Output, pointer: VersionPointer) -> dict[str, bytes]:
    """The manifests the pointer lists, as published (an unreadable one as ``{}``)."""
    return {m: s3_output.get_bytes(output, f"{pointer.version_dir()}/{m}") or b"{}" for m in pointer.manifests}


def published_manifests(output: S3Output) -> list[tuple[str, WdinfoManifest]]:
    """The manifests of the version ``output``'s pointer names (path in its folder, manifest); []
    when there is no pointer."""
    pointer = s3_output.read_pointer(output)
    if pointer is None:
        return []
    found = []
    for rel in pointer.manifests:
        origin = f"{output}/{pointer.version_dir()}/{rel}"
        data = s3_output.get_bytes(output, f"{pointer.version_dir()}/{rel}")
        if data is None:
            raise BuildError(f"{origin}: listed by {output}/{POINTER_NAME} but missing; rebuild the source")
        found.append((rel, parse_wdinfo(load_state_doc(data, origin), rel.rpartition("/")[0] or ".", origin)))
    return found


def published_problems(output: S3Output) -> list[str]:
    """What the published version's objects lack against its manifests (a listing per version
    folder): each tar the manifests list, with its size, and each key index they name."""
    pointer = s3_output.read_pointer(output)
    if pointer is None:
        return [f"{output}/{POINTER_NAME}: missing (nothing is published)"]
    listings: dict[str, dict[str, int]] = {}
    problems = []
    for rel, man in published_manifests(output):
        leaf = rel.rpartition("/")[0]
        # A sibling root (section 9c): the tars are at the same paths in that version's folder.
        home = pointer.version if man.root == "." else sibling_version(man.root) or pointer.version
        for vid in {home, pointer.version}:
            if vid not in listings:
                listings[vid] = s3_output.list_sizes(output, version_dir(vid))
        for t in man.tars:
            for m in man.data_keys:
                tar = "/".join(p for p in (leaf, m, t.path) if p)
                if listings[home].get(tar) != t.bytes.get(m):
                    problems.append(f"{output}/{version_dir(home)}/{tar}: {listings[home].get(tar, 'missing')} in the "
                                    f"bucket, {rel} lists {t.bytes.get(m)} bytes")
            index = "/".join(p for p in (leaf, t.key_index or "") if p)
            if t.key_index is None or index not in listings[pointer.version]:
                problems.append(f"{output}/{pointer.version_dir()}/{rel}: the key index of {t.path} is missing")
    return problems


def published_config(output: S3Output) -> ShardingConfig:
    """The settings the published version was cut with (its ``.pid-build/sharding.json``)."""
    pointer = s3_output.read_pointer(output)
    data = s3_output.get_bytes(output, f"{pointer.version_dir()}/{STATE_DIR}/sharding.json") if pointer else None
    if data is None:
        raise BuildError(f"{output}: no published version with its settings (.pid-build/sharding.json); rebuild it")
    return ShardingConfig(**load_state_doc(data, f"{output}/{pointer.version_dir()}/{STATE_DIR}/sharding.json"))


def published_state(output: S3Output, *names: str) -> dict[str, bytes | None]:
    """Each of the state files ``names`` as the version the pointer names carries it (the pointer
    read once: all from one version), None where it carries none or nothing is published."""
    pointer = s3_output.read_pointer(output)
    return {n: s3_output.get_bytes(output, f"{pointer.version_dir()}/{STATE_DIR}/{n}") if pointer else None
            for n in names}


def pull_committed_intake(output: S3Output, work: Path) -> bool:
    """The intake the published version carries (samples, report, validation level, outcomes)
    as this machine's staged samples, replacing any it had: a re-shard of the published samples
    on any machine. False when nothing is published, or its version carries no samples."""
    found = published_state(output, *(n for n in staging.INTAKE_STATE if n != FINGERPRINT))
    if found.get(SAMPLES) is None:
        return False
    with build_lock(work):
        state = state_dir(versions.begin(work, first_step=True))
        for name in staging.INTAKE_STATE:
            (state / name).unlink(missing_ok=True)  # a stale intake of this machine's goes
        _write_state(state, found)
    return True


def seed_intake_cache(output: S3Output, work: Path) -> bool:
    """The published version's file outcomes as this machine's staged intake cache, unless it
    has one: an intake here validates only the files changed since, on a fresh machine too."""
    with build_lock(work):
        cache = state_dir(versions.staging_dir(work)) / CACHE_NAME
        if cache.is_file():
            return False
        data = published_state(output, CACHE_NAME)[CACHE_NAME]
        if data is None:
            return False
        _write_state(state_dir(versions.begin(work, first_step=True)), {CACHE_NAME: data})
    return True


def published_intake_matches(output: S3Output, staging_folder: Path, config: ShardingConfig) -> bool:
    """Whether the version the pointer names was cut with ``config`` from exactly the samples
    staged in ``staging_folder`` (the same samples, report and validation level), and every
    object its manifests list is there: a rebuild would publish that version again."""
    state = state_dir(staging_folder)
    for name, published in published_state(output, SAMPLES, REPORT, INTAKE_SETTINGS).items():
        if published is None or not (state / name).is_file() or (state / name).read_bytes() != published:
            return False
    try:
        if published_config(output) != config:
            return False
    except BuildError:
        return False
    return not published_problems(output)


def discard_staging(work: Path) -> None:
    """Remove this machine's staging of the build (the bucket serves what it would publish)."""
    with build_lock(work):
        shutil.rmtree(versions.staging_dir(work), ignore_errors=True)
