"""Publishing a source's build: stage a complete new version beside the output, then swap folders.

A build never writes into its output folder F. It writes the whole new version (tars, key
indexes, ``wdinfo.json`` and its ``.pid-build/`` state) into the staging folder
S = ``<parent>/.<name>.pid-staging``, hard-linking the unchanged tars from F. The commit renames
F to ``.<name>.pid-old``, S to F, and deletes the old folder. Until that first rename, F is
exactly as the last good build left it, however the build fails; a crash between the two
renames is repaired by the next build step (``begin``).

Files in F that no build writes (a user's notes, another tool's output) are hard-linked into
S before the swap, so they survive it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from loader.formats.atomic import atomic_write_bytes, is_temp_file, temp_name
from loader.formats.layout import BUILD_OUTPUT_PATH
from pid_platform.sharding.commit.manifests import listed_outputs
from pid_platform.sharding.errors import BuildError, ForeignOutputError, OutputNotWritableError
from pid_platform.sharding.layout import PROBE_PREFIX, STATE_DIR, ensure_writable, final_dir

STAGING_SUFFIX = ".pid-staging"
OLD_SUFFIX = ".pid-old"
# Written into S's state just before the swap: "S is complete; finishing the swap is safe".
COMMITTING = "COMMITTING"


def staging_dir(out: str | os.PathLike[str]) -> Path:
    final = final_dir(out)
    return final.parent / f".{final.name}{STAGING_SUFFIX}"


def old_dir(out: str | os.PathLike[str]) -> Path:
    final = final_dir(out)
    return final.parent / f".{final.name}{OLD_SUFFIX}"


def prepare(out: str | os.PathLike[str], *, first_step: bool = False, force: bool = False) -> Path:
    """Repair an interrupted commit of ``out`` and check it may be built; return F. Creates nothing.

    ``first_step`` (intake): also refuse an output folder no build made, unless ``force``.
    """
    final = final_dir(out)
    if final.exists() and not final.is_dir():
        raise OutputNotWritableError(f"output folder {out} is a file; choose another --output-dir")
    recover(final)
    _refuse_old(final)  # before any work: the commit could not move F aside
    if first_step:
        check_ours(out, force=force)
    return final


def begin(out: str | os.PathLike[str], *, first_step: bool = False, force: bool = False) -> Path:
    """Start (or continue) a build step of ``out``: ``prepare``, then create (or take over) S and
    prove it writable; return S."""
    final = prepare(out, first_step=first_step, force=force)
    staging = ensure_writable(staging_dir(final), shown_as=Path(out))
    # The step is about to change S: an earlier commit that stopped before its swap no longer
    # vouches for S being complete.
    (staging / STATE_DIR / COMMITTING).unlink(missing_ok=True)
    return staging


def discard_empty_staging(out: str | os.PathLike[str]) -> bool:
    """Remove S if it holds no file (a build that failed before writing anything, e.g. intake
    with no valid sample): no empty folder is left beside the output. A staging folder with
    files is kept, for the next build to continue from. Call it holding the build lock."""
    staging = staging_dir(out)
    if not staging.is_dir():
        return False
    folders = []
    for dirpath, dirs, files in os.walk(staging):
        if files or any(os.path.islink(os.path.join(dirpath, d)) for d in dirs):
            return False
        folders.append(dirpath)
    for d in reversed(folders):  # deepest first
        os.rmdir(d)
    return True


def recover(out: str | os.PathLike[str]) -> None:
    """Finish or undo a commit that stopped between or after its renames (F -> old, S -> F)."""
    final, staging, old = final_dir(out), staging_dir(out), old_dir(out)
    if not final.exists():
        if (staging / STATE_DIR / COMMITTING).is_file():
            os.rename(staging, final)  # S was complete: finish the swap
            _fsync(final.parent)
        elif old.exists():
            os.rename(old, final)  # S was not complete: put the previous version back
            _fsync(final.parent)
            return
        else:
            return
    # The marker came into F with S: it says F is the new version, so the old one may go. An F
    # without it next to an old folder was not made by a swap; both are left for a person.
    if (final / STATE_DIR / COMMITTING).is_file():
        _finish(final, old)


def commit(out: str | os.PathLike[str]) -> list[Path]:
    """Publish S as F. S must hold the complete new version (manifests included).

    Returns the build files (tars, key indexes, manifests) of the previous version that the new
    one no longer has, as paths under ``out``.
    """
    final, staging, old = final_dir(out), staging_dir(out), old_dir(out)
    recover(final)
    _refuse_old(final)
    removed: list[Path] = []
    _clear_carried(staging)  # what an earlier attempt carried over may be out of date
    if final.exists():
        new = set(_build_files(staging))
        owned = listed_outputs(final) or set()
        removed = [Path(out) / rel for rel in sorted(_build_files(final)) if rel in owned and rel not in new]
        clashes = _carry(final, staging, owned)
        if clashes:
            raise BuildError(
                f"{clashes[0]} (and {len(clashes) - 1} more) in {final} was not written by a build of it, "
                "and the new version writes a file of the same name; move those files out of "
                f"{final} and re-run (nothing was published)"
            )
    # Tars are written without a per-file fsync (the writer's hot path); here, before anything
    # points readers at it, the staged version is made durable. Only S's own files: os.sync()
    # would also wait for every other dirty page on the machine.
    _fsync_tree(staging)
    atomic_write_bytes(staging / STATE_DIR / COMMITTING, b"")
    if final.exists():
        os.rename(final, old)
    os.rename(staging, final)
    _fsync(final.parent)
    _finish(final, old)
    return removed


def _refuse_old(final: Path) -> None:
    old = old_dir(final)
    if old.exists():
        raise BuildError(
            f"{old} holds a previous version of {final} that no build could clear away (an "
            f"interrupted commit next to a {final.name} folder it did not make, or files that differ "
            f"from those in {final}); move what you need into {final}, delete {old}, and re-run"
        )


def link_atomic(src: Path, dst: Path) -> None:
    """Make ``dst`` a hard link of ``src``, replacing whatever ``dst`` was in one rename.

    Safe for tars because no build modifies a file in place: a new version is always a new
    file renamed over the old name, so the two names never start to differ in content.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(dst)
    tmp.unlink(missing_ok=True)
    os.link(src, tmp)
    os.replace(tmp, dst)


def _written_by_build(root: Path, path: Path, listed: set[Path]) -> bool:
    """Whether the build that made ``root`` wrote ``path``: its state, its temporary files, and
    the outputs its state lists (``listed``) - not whatever merely looks like a tar."""
    rel = path.relative_to(root)
    return (
        rel.parts[0] == STATE_DIR
        or is_temp_file(path)
        or path.name.startswith(PROBE_PREFIX)
        or rel in listed
    )


def check_ours(out: str | os.PathLike[str], *, force: bool = False) -> None:
    """Refuse to publish over a non-empty folder no build made, unless ``force``.

    A published version carries its build state (``.pid-build/``); a folder with files and
    without it is someone else's, and a build replaces what it publishes.
    """
    final = final_dir(out)
    if force or not final.is_dir() or (final / STATE_DIR).is_dir():
        return
    with os.scandir(final) as it:
        names = sorted(e.name for e in it)
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ForeignOutputError(
            f"output folder {out} holds files ({shown}) but no {STATE_DIR}/ of a previous build, so it "
            "was not made by pid-shard; choose an empty or new folder, or pass --force (force=True) to "
            "build into it anyway (files no build wrote are kept)"
        )


def _build_files(root: Path) -> list[Path]:
    """Tars, key indexes and manifests under ``root``, relative to it."""
    found = []
    for dirpath, dirs, files in os.walk(root):
        d = Path(dirpath)
        if d == root:
            dirs[:] = [x for x in dirs if x != STATE_DIR]
        found += [r for r in ((d / f).relative_to(root) for f in files) if BUILD_OUTPUT_PATH.match(r.as_posix())]
    return found


def _carry(src: Path, dst: Path, owned: set[Path] | None = None) -> list[Path]:
    """Hard-link into ``dst`` every entry of ``src`` its build did not write (empty folders
    recreated); ``owned``: the outputs ``src``'s build state lists (read from it if not given).

    Returns the entries ``dst`` already holds as a different file (nothing is overwritten).
    """
    conflicts: list[Path] = []
    if owned is None:
        owned = listed_outputs(src) or set()

    def walk(d: Path) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        if not entries and d != src:
            (dst / d.relative_to(src)).mkdir(parents=True, exist_ok=True)
        for e in entries:
            p = Path(e.path)
            if d == src and e.name == STATE_DIR:
                continue
            if e.is_dir(follow_symlinks=False):
                walk(p)
                continue
            if _written_by_build(src, p, owned):
                continue
            target = dst / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, target, follow_symlinks=False)  # a symlink is carried as the link
            except FileExistsError:
                if not os.path.samestat(os.lstat(p), os.lstat(target)):
                    conflicts.append(p)

    walk(src)
    return conflicts


def _clear_carried(staging: Path) -> None:
    """Remove from S what an earlier, interrupted commit carried over from F.

    S is the build's private folder: anything in it no build writes came from ``_carry``, is a
    second link to a file in F, and is carried again (as F holds it now) right after.
    """
    folders = []
    owned = listed_outputs(staging) or set()
    for dirpath, dirs, files in os.walk(staging):
        d = Path(dirpath)
        if d == staging:
            dirs[:] = [x for x in dirs if x != STATE_DIR]
        else:
            folders.append(d)
        for name in files + [x for x in dirs if (d / x).is_symlink()]:
            if not _written_by_build(staging, d / name, owned):
                (d / name).unlink()
    for d in reversed(folders):  # deepest first
        with contextlib.suppress(OSError):
            d.rmdir()  # only succeeds when empty


def _finish(final: Path, old: Path) -> None:
    """Delete the replaced version, then the marker that allowed it."""
    # A file created in F between the carry-over and the swap went to the old folder with F:
    # carry it too. If the old folder holds a file F holds differently, keep the old folder
    # (the next commit names it) rather than delete anything the build did not write.
    if old.exists() and not _carry(old, final):
        shutil.rmtree(old)
    if not old.exists():
        (final / STATE_DIR / COMMITTING).unlink(missing_ok=True)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (cheap for files already on disk, such as
    tars hard-linked from the published version)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                _fsync(p)
        _fsync(dirpath)


def _fsync(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder (its entries: a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
