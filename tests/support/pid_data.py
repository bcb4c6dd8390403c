"""Output in the shape PiD's ``scripts/sharding_wds.py`` writes it (nv-tlabs/PiD), for the tests
that read PiD-written data. No PiD code: its documented output, written with ``tarfile``.

* members ``<dataset>__<basename><ext>``: the basename keeps its dots
  (``photos__rotated.exif6.jpg``), one tar per modality folder, same order in each;
* ``<out>/<bucket>/<modality>/part_<NNNNNN>/<NNNNNN>.tar`` (``tarfile`` headers with PiD's
  defaults: a ``TarInfo`` with only name and size set);
* one ``wdinfo.json`` per bucket, ``indent=2``: ``data_keys``, ``data_list``,
  ``data_list_key_count``, ``root`` (the bucket folder's absolute path), ``total_key_count``;
  no ``format_version``, no ``chunk_size``, no checksums, no key index.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from loader.formats.layout import shard_relpath


def write_pid_output(out: Path, dataset: str, samples: dict[str, dict[str, tuple[str, bytes]]], *,
                     bucket: str = "aspect_ratio_1_1", shard_size: int = 2) -> Path:
    """``samples``: basename -> modality -> (extension with its dot, bytes). Returns the manifest."""
    leaf = out / bucket
    names = sorted(samples)
    modalities = sorted({m for s in samples.values() for m in s})
    data_list, counts = [], []
    for index, start in enumerate(range(0, len(names), shard_size)):
        group = names[start:start + shard_size]
        rel = shard_relpath(index)
        for m in modalities:
            path = leaf / m / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(path, "w") as tar:
                for basename in group:
                    ext, data = samples[basename][m]
                    info = tarfile.TarInfo(name=f"{dataset}__{basename}{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        data_list.append(rel)
        counts.append(len(group))
    manifest = {"data_keys": modalities, "data_list": data_list, "data_list_key_count": counts,
                "root": str(leaf.absolute()), "total_key_count": sum(counts)}
    path = leaf / "wdinfo.json"
    path.write_text(json.dumps(manifest, indent=2))
    return path
