"""A source's listing as columns: its modality folders, the basename intersection, and every
file left out with its reason, decided before any file is read.

The complete samples are one Arrow table in basename order (the stable order intake tasks are
cut from), so a source of ten million samples is listed and joined as column bytes, never as a
Python object per file; objects are made only for the files a build has to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pid_platform.sharding.compute import ascending, pc
from pid_platform.sharding.errors import NoModalitiesError
from pid_platform.sharding.intake.file_checks import IMAGE_EXTS, ext_of
from pid_platform.sharding.intake.report import MAX_EXAMPLES, IntakeReport
from pid_platform.sharding.storage import FileEntry, Listing, SourceStore

BASENAME = "basename"
FILE_COLUMNS = ("name", "size", "fingerprint")  # of a listed file; ``<column>.<modality>`` in a sample's row


def stems(names: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each name's stem, its basename: all before the last dot (the whole name without one)."""
    return pc.replace_substring_regex(names, r"(?s)\.[^.]*\z", "")


def raw_extensions(names: pa.Array | pa.ChunkedArray) -> pa.Array:
    """All after each name's last dot, as written (``ext_of`` lowers it); "" without a dot."""
    return pc.if_else(pc.match_substring(names, "."), pc.replace_substring_regex(names, r"(?s)\A.*\.", ""), "")


@dataclass
class SourceListing:
    """What listing a source decides: the report's listing part, and the complete samples."""

    report: IntakeReport
    # ``basename``, then per modality (sorted) ``name.<m>``, ``size.<m>``, ``fingerprint.<m>``;
    # one row per complete sample, in basename order.
    complete: pa.Table
    folders: dict[str, str | None]  # modality -> the local folder of its files (None on S3)

    @property
    def modalities(self) -> list[str]:
        return self.report.modalities

    def __len__(self) -> int:
        return self.complete.num_rows

    def entries(self, table: pa.Table) -> list[dict[str, FileEntry]]:
        """The files (modality -> file) of each row of ``table`` (rows of ``complete``), as objects:
        only for the few rows a build must read."""
        d = table.to_pydict()
        return [{m: FileEntry(m, d[f"name.{m}"][i], d[f"size.{m}"][i], d[f"fingerprint.{m}"][i], self.folders[m])
                 for m in self.modalities} for i in range(table.num_rows)]

    def weights(self, file_cost: int) -> np.ndarray:
        """What validating each complete sample costs, in bytes read: its files' sizes plus
        ``file_cost`` per file. Bytes stand for the decode cost (a full decode of a photograph is
        about linear in its file size, far more than in its count), and are known before any read."""
        total = np.full(len(self), file_cost * len(self.modalities), dtype=np.int64)
        for m in self.modalities:
            total += self.complete[f"size.{m}"].to_numpy()
        return total


def _pick_image_modality(modalities: list[str], listings: dict[str, Listing]) -> str | None:
    if "image" in listings:
        return "image"
    for m in modalities:
        head = listings[m].files["name"][:64].to_pylist()
        if head and all(ext_of(n) in IMAGE_EXTS for n in head):
            return m
    return None


def flat(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One array of ``column``'s values: its only chunk as it is (``combine_chunks`` copies even one)."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def note_codes(report: IntakeReport, codes: np.ndarray, labels: Sequence[str], what: pa.Array) -> None:
    """``report.note_many(labels[codes[i]], [what[i]], 1)`` for every row ``i`` with a code >= 0, in row
    order, counted as columns: each reason's first rows are its examples."""
    for code in np.unique(codes[codes >= 0]):
        rows = np.flatnonzero(codes == code)
        report.note_many(labels[code], what.take(pa.array(rows[:MAX_EXAMPLES])).to_pylist(), len(rows))


def list_source(store: SourceStore, source: str) -> SourceListing:
    """List ``source``: modality folders, basename intersection and every file left out with
    its reason (``IntakeReport`` without validation outcomes)."""
    report = IntakeReport(source)
    modalities = store.list_modalities(source)
    listings: dict[str, Listing] = {}
    for m in modalities:
        listing = store.list_files(source, m)
        for rel, reason in listing.skipped:
            report.note_many(reason, [rel], 1, report.skipped_files)
        if listing.duplicate_of is not None:
            continue  # a link to another modality folder: its files are read once, there
        report.files_seen[m] = len(listing)
        if len(listing):
            listings[m] = listing
        else:
            report.empty_modalities.append(m)
    active = sorted(listings)
    if not active:
        raise NoModalitiesError(
            f"source {source!r} at {store.uri}: no modality folder holds any file "
            f"(folders: {modalities}); put files under e.g. {source}/image/ and {source}/caption/"
        )
    report.modalities = active
    report.image_modality = _pick_image_modality(active, listings)
    complete = _join(report, {m: listings[m].files for m in active})
    return SourceListing(report, complete, {m: listings[m].folder for m in active})


def _all_complete(files: dict[str, pa.Table]) -> pa.Array | None:
    """The basenames, when every folder holds each once and in name order; else None."""
    active = list(files)
    first = flat(stems(files[active[0]]["name"]))
    if not ascending(first):
        return None
    for m in active[1:]:
        other = flat(stems(files[m]["name"]))
        if len(other) != len(first) or not bool(pc.all(pc.equal(other, first)).as_py()):
            return None
    return first


def _join(report: IntakeReport, files: dict[str, pa.Table]) -> pa.Table:
    """The complete samples of the modalities' ``files`` (each sorted by name); notes ambiguous
    basenames (x.jpg and x.png in one folder: no safe choice) and incomplete ones."""
    active = list(files)
    first = _all_complete(files)
    if first is not None:
        # Every basename once in each folder, in name order: every sample is complete, and the
        # listing's columns are the table's (no hash table, no copy: what a big clean drop costs).
        for m in active:
            report.orphans[m] = 0
        columns = {BASENAME: first}
        for m in active:
            columns.update({f"{c}.{m}": flat(files[m][c]) for c in FILE_COLUMNS})
        return pa.table(columns)
    per_file = {m: flat(stems(files[m]["name"])) for m in active}  # modality -> each file's stem
    unique: dict[str, pa.Array] = {}  # modality -> its stems, once each
    ambiguous: list[pa.Array] = []
    for m in active:
        counts = pc.value_counts(per_file[m])
        unique[m] = counts.field("values")
        ambiguous.append(pc.filter(unique[m], pc.greater(counts.field("counts"), 1)))
    ambiguous_stems = pc.unique(pa.concat_arrays(ambiguous)).sort()
    report.note_many("ambiguous_basename", ambiguous_stems[:MAX_EXAMPLES].to_pylist(), len(ambiguous_stems))

    # How many modalities hold each basename; an ambiguous one is in no sample and no orphan.
    every = pc.value_counts(pa.concat_arrays([unique[m] for m in active]))
    seen_in, times = every.field("values"), every.field("counts").to_numpy()
    clear = ~pc.is_in(seen_in, value_set=ambiguous_stems).to_numpy(zero_copy_only=False)
    complete_stems = pc.filter(seen_in, pa.array(clear & (times == len(active))))
    partial = pc.filter(seen_in, pa.array(clear & (times < len(active)))).sort()
    # Each incomplete basename: the modalities holding it as a bit mask; its reason names the rest.
    mask = np.zeros(len(partial), dtype=np.int64)
    for bit, m in enumerate(active):
        present = pc.is_in(partial, value_set=unique[m]).to_numpy(zero_copy_only=False)
        report.orphans[m] = int(present.sum())
        mask |= present.astype(np.int64) << bit
    masks = np.unique(mask)
    labels = ["missing_modality: " + ",".join(m for b, m in enumerate(active) if not (int(k) >> b) & 1)
              for k in masks]
    note_codes(report, np.searchsorted(masks, mask), labels, partial)

    columns: dict[str, pa.Array] = {}
    for m in active:
        keep = pc.is_in(per_file[m], value_set=complete_stems)
        stem = pc.filter(per_file[m], keep)
        order = pc.array_sort_indices(stem)
        rows = files[m].filter(keep).take(order)
        columns.setdefault(BASENAME, stem.take(order))
        columns.update({f"{c}.{m}": flat(rows[c]) for c in FILE_COLUMNS})
    return pa.table(columns)
