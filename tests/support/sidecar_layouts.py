"""Sidecars in the layouts we READ but no longer write, made independently of our writer.

* ``write_lerobot_only_sidecar``: what LeRobot's own writer produces (``np.savez_compressed`` with
  a ``manifest_json`` bytes member and ``<i>/<array>`` members), with LeRobot's fields only and
  none of ours, from a real dataset's MP4 box index.
* ``write_legacy_sidecar``: the ``__manifest__`` + ``f00000/...`` layout our previous writer
  published (kept here as a test helper: caches and branches still hold such files).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from loader.io import roots as fs
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.mp4 import index_mp4
from loader.lerobot.sidecar import ARRAY_NAMES, SidecarManifest

LEROBOT_MP4_KEYS = ("file_path", "file_size", "ftyp", "moov_offset", "mdat_offset", "mdat_payload_offset",
                    "mdat_payload_size", "faststart", "codec", "timescale", "duration", "track_id",
                    "width", "height", "stsd_body")
LEROBOT_SIDECAR_KEYS = ("schema_version", "repo_id", "revision", "data_root", "source_files",
                        "source_fingerprints")


def _mp4_fields(rel: str, idx: Any) -> dict[str, Any]:
    mdat_offset, mdat_size = idx.mdat[0]
    header = 16 if mdat_size > 0xFFFFFFFF else 8
    return {
        "file_path": rel, "file_size": idx.file_size, "ftyp": idx.ftyp.hex(),
        "moov_offset": idx.moov[0], "mdat_offset": mdat_offset,
        "mdat_payload_offset": mdat_offset + header, "mdat_payload_size": mdat_size - header,
        "faststart": idx.moov[0] < mdat_offset, "codec": idx.codec, "timescale": idx.timescale,
        "duration": int(np.sum(idx.sample_durations)), "track_id": idx.track_id,
        "width": idx.width, "height": idx.height, "stsd_body": idx.stsd[8:].hex(),
    }


def write_lerobot_only_sidecar(root: str | Path, out: Path, *, repo_id: str, revision: str,
                               version: int = 3, schema_version: int = 3,
                               fingerprints: Mapping[str, str] | None = None,
                               drop_arrays: Iterable[str] = ()) -> dict[str, dict[str, np.ndarray]]:
    """Index ``root``'s videos and write them as LeRobot writes a sidecar. Returns the arrays by
    path. ``drop_arrays`` leaves out those array names (e.g. LeRobot's schema 2 had no
    ``sample_composition_offsets``); ``fingerprints`` fills ``source_fingerprints``."""
    rels = LeRobotMeta.load(str(root)).video_files()
    indexes = {rel: index_mp4(fs.url(str(root), rel)) for rel in rels}
    drop = set(drop_arrays)
    payload = {
        "version": version,
        "sidecar": {
            "schema_version": schema_version, "repo_id": repo_id, "revision": revision,
            "data_root": str(root), "source_files": [[rel, indexes[rel].file_size] for rel in rels],
            "source_fingerprints": dict(fingerprints) if fingerprints else {},
        },
        "files": [{"file_path": rel, "file_size": indexes[rel].file_size,
                   "mp4": _mp4_fields(rel, indexes[rel])} for rel in rels],
    }
    arrays: dict[str, dict[str, np.ndarray]] = {}
    members: dict[str, np.ndarray] = {}
    for i, rel in enumerate(rels):
        arrays[rel] = {name: np.asarray(getattr(indexes[rel], name)) for name in ARRAY_NAMES}
        members.update({f"{i}/{name}": a for name, a in arrays[rel].items() if name not in drop})
    np.savez_compressed(out, manifest_json=json.dumps(payload).encode("utf-8"), **members)
    return arrays


def write_legacy_sidecar(out: Path, manifest: SidecarManifest,
                         arrays: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """The previous writer: ``__manifest__.npy`` (uint8 flat JSON) and ``f<5 digits>/<array>``."""
    files = sorted(manifest.files, key=lambda f: f.path)
    entries = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for i, f in enumerate(files):
            fid = f"f{i:05d}"
            entry = {k: v for k, v in f.to_dict().items() if k not in ("moov_offset", "duration", "identity")}
            entries.append(entry | {"id": fid})
            for name in ARRAY_NAMES:
                with zf.open(f"{fid}/{name}.npy", "w") as fh:
                    np.lib.format.write_array(fh, np.asarray(arrays[f.path][name]), allow_pickle=False)
        flat = manifest.to_dict() | {"files": entries}
        raw = json.dumps(flat, sort_keys=True, separators=(",", ":")).encode("utf-8")
        with zf.open("__manifest__.npy", "w") as fh:
            np.lib.format.write_array(fh, np.frombuffer(raw, dtype=np.uint8), allow_pickle=False)
