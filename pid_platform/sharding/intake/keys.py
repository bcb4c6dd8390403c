"""The kept samples as the samples table: WebDataset-safe unique keys, aspect buckets, key order.

Computed as columns over every kept sample; only the rare names that need more than a
character substitution (over-long ones, two that sanitise alike) are handled one by one, by
the same functions that define them (``loader.formats.twin_tar``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from loader.formats.twin_tar import MAX_KEY_LEN, disambiguate_key, nearest_bucket, sanitize_key
from pid_platform.sharding.compute import ascending, pc
from pid_platform.sharding.intake.listing import BASENAME, FILE_COLUMNS, flat
from pid_platform.sharding.intake.report import MAX_EXAMPLES, IntakeReport


def sanitized_keys(basenames: pa.Array) -> pa.Array:
    """``sanitize_key`` of each basename: every character outside ``[A-Za-z0-9_-]`` becomes
    ``_`` (the same per code point as Python's ``re``); empty and over-long keys as it makes them."""
    keys = flat(pc.replace_substring_regex(basenames, r"[^A-Za-z0-9_-]", "_"))
    if len(keys) and bool(pc.all(pc.equal(keys, basenames)).as_py()):
        keys = basenames  # names already safe (a crawl's ids): one column, not two alike
    special = np.flatnonzero(pc.or_(pc.equal(pc.utf8_length(keys), 0),
                                    pc.greater(pc.utf8_length(keys), MAX_KEY_LEN)).to_numpy(zero_copy_only=False))
    if len(special) == 0:
        return keys
    fixed = [sanitize_key(b) for b in basenames.take(pa.array(special)).to_pylist()]
    return _replaced(keys, special, fixed)


def _replaced(values: pa.Array, rows: np.ndarray, new: Sequence[str]) -> pa.Array:
    mask = np.zeros(len(values), dtype=bool)
    mask[rows] = True
    # pc.replace_with_mask takes the replacements in the order of the rows it replaces.
    return pc.replace_with_mask(values, pa.array(mask), pa.array(list(new), pa.string()))


def buckets(width: pa.Array, height: pa.Array) -> pa.Array:
    """``nearest_bucket`` of each sample with a size, decided once per distinct size; null
    without one (no image modality, or a zero width)."""
    w = pc.fill_null(width, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    h = pc.fill_null(height, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    has = w != 0
    sizes, where = np.unique((w[has] << 32) | h[has], return_inverse=True)
    names = [nearest_bucket(int(s >> 32), int(s & 0xFFFFFFFF)) for s in sizes]
    labels = pa.array(names, pa.string())
    out = np.full(len(w), -1, dtype=np.int64)
    out[has] = where
    return labels.take(pa.array(out, mask=out < 0)) if len(labels) else pa.nulls(len(w), pa.string())


def keyed_samples(report: IntakeReport, kept: pa.Table, modalities: Sequence[str], folders: dict[str, str | None],
                  width: pa.Array, height: pa.Array, *, classify_aspect_ratio: bool) -> pa.Table:
    """The samples table (``plan.tables.samples_table``'s columns) of the ``kept`` rows of the
    listing (in basename order) with their image sizes, sorted by key; key collisions are
    renamed and counted in ``report``."""
    basenames = flat(kept[BASENAME])
    keys = sanitized_keys(basenames)
    counts = pc.value_counts(keys)
    colliding = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    clash = np.flatnonzero(pc.is_in(keys, value_set=colliding).to_numpy(zero_copy_only=False))
    report.key_collisions = len(clash)
    if len(clash):
        # Two names that sanitise alike both keep their data under distinct, stable keys.
        stems = basenames.take(pa.array(clash)).to_pylist()
        old = keys.take(pa.array(clash)).to_pylist()
        new = [disambiguate_key(k, s) for k, s in zip(old, stems, strict=True)]
        examples = zip(stems[:MAX_EXAMPLES], new[:MAX_EXAMPLES], strict=True)  # the count is key_collisions
        report.examples["key_collision_renamed"] = [f"{s} -> {k}" for s, k in examples]
        keys = _replaced(keys, clash, new)
    bucket = buckets(width, height) if classify_aspect_ratio else pa.nulls(len(keys), pa.string())
    columns: dict[str, pa.Array] = {
        "key": keys, "basename": basenames, "width": flat(width).cast(pa.int32()),
        "height": flat(height).cast(pa.int32()), "bucket": bucket,
    }
    for m in modalities:
        columns.update({f"{c}.{m}": flat(kept[f"{c}.{m}"]) for c in FILE_COLUMNS})
        names = columns[f"name.{m}"]
        folder = folders[m]
        columns[f"path.{m}"] = (pa.nulls(len(names), pa.string()) if folder is None
                                else flat(pc.binary_join_element_wise(folder, names, "/")))
    table = pa.table(columns)
    if not ascending(keys):  # basename order is key order unless a name needed another key
        table = table.take(pc.sort_indices(table["key"])).combine_chunks()
    sorted_keys = flat(table["key"])
    if len(sorted_keys) > 1 and not ascending(sorted_keys):
        same = np.flatnonzero(pc.equal(sorted_keys[1:], sorted_keys[:-1]).to_numpy(zero_copy_only=False))
        if len(same):  # only if a digest suffix collided with a natural key: astronomically rare
            dup = sorted_keys.take(pa.array(same[:5])).to_pylist()
            raise RuntimeError(f"source {report.source!r}: keys still collide after disambiguation: {dup}")
    return table
