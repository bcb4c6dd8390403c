"""Rewrite the ``root`` of every manifest of an existing build: relative, absolute, or a URL.

A build writes relative roots by default (``"."``: moved data keeps working for our reader).
PiD's reader joins ``root`` to its working directory, so a PiD training job needs absolute roots:
the output folder's absolute path, or the URL the folder was uploaded to. This changes only the
``root`` field, under the build lock, each manifest replaced atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

from loader.formats.errors import FormatError
from loader.formats.layout import STATE_DIR, WDINFO_NAME
from loader.formats.wdinfo import manifest_root, read_wdinfo, rewrite_root, root_base
from loader.io import urls
from pid_platform.sharding.commit.state import refresh_outputs
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.output_lock import build_lock
from pid_platform.sharding.plan.add_modality import (
    load_plan_cut,
    refuse_keep_for_positional_readers,
)


def find_manifests(out: Path) -> list[Path]:
    """The manifests of a build output (its build state left out), sorted."""
    found = []
    for dirpath, dirs, files in os.walk(out):
        dirs[:] = sorted(d for d in dirs if d != STATE_DIR and not d.startswith("."))
        if WDINFO_NAME in files:
            found.append(Path(dirpath) / WDINFO_NAME)
    return sorted(found)


def _check_tars_beside(path: Path) -> None:
    """A local root must name where the tars are: the build's layout puts them beside the manifest."""
    man = read_wdinfo(path)
    for m in man.data_keys:
        for t in man.tars[:1]:
            tar = path.parent / m / t.path
            if not tar.is_file():
                raise FormatError(
                    f"{path}: its tars are not beside it ({tar} is missing), so a root pointing at its folder "
                    f"would be wrong; it keeps root {man.root!r}. Rewrite roots only of a build's output folder"
                )


def rewrite_manifest_roots(out: str | os.PathLike[str], mode: str) -> list[Path]:
    """Set every manifest's root under ``out``: ``"relative"`` (``"."``), ``"absolute"`` (its
    folder's absolute path) or a URL ``out`` is published at (``<url>/<folder below out>``).

    Returns the manifests that changed. Refuses (``FormatError``, nothing written) an unknown
    mode, a folder without manifests, or, for a local root, a manifest whose tars are not beside it.
    """
    out = final_dir(out)
    base = root_base(mode, out)
    refuse_keep_for_positional_readers(mode, str(out), cut=load_plan_cut(out))
    with build_lock(out):
        manifests = find_manifests(out)
        if not manifests:
            raise FormatError(f"no {WDINFO_NAME} under {out}; give a build's output folder")
        local = base is None or not urls.has_scheme(base)
        if local:
            for path in manifests:
                _check_tars_beside(path)
        changed = []
        for path in manifests:
            leaf = path.parent.relative_to(out).as_posix()
            if rewrite_root(path, manifest_root(base, "" if leaf == "." else leaf)):
                changed.append(path)
        # The build state's checksums follow, so a rebuild asking for these roots is still a no-op.
        refresh_outputs(out, [p.relative_to(out).as_posix() for p in changed])
        return changed
