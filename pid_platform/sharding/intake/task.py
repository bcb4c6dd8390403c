"""Intake: discover modality folders, intersect basenames, validate files, make keys safe.

Every file looked at ends up either in a sample or in the report with a reason. The listing,
the outcomes and the samples are columns (``listing``, ``outcomes``, ``keys``): only the files a
build has to read become objects.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pid_platform.sharding.compute import pc
from pid_platform.sharding.errors import NoSamplesError
from pid_platform.sharding.intake.cache import IntakeCache
from pid_platform.sharding.intake.file_checks import VALIDATE_FULL, check_validate_level
from pid_platform.sharding.intake.keys import keyed_samples
from pid_platform.sharding.intake.listing import BASENAME, flat, list_source, note_codes
from pid_platform.sharding.intake.outcomes import decide
from pid_platform.sharding.intake.report import IntakeReport
from pid_platform.sharding.storage import FileEntry, SourceStore


@dataclass(frozen=True)
class Sample:
    """A sample as an object: for the steps that hold a shard's samples (the writers, the
    one-process plan), read back from the samples or plan table."""

    key: str  # WebDataset-safe, unique within the source
    basename: str  # original file stem shared by all modalities
    files: dict[str, FileEntry]  # modality -> file
    width: int | None = None
    height: int | None = None
    bucket: str | None = None


def slice_bounds(total: int, index: int, of: int) -> tuple[int, int]:
    """Items ``[start, stop)`` of ``total`` that task ``index`` of ``of`` takes: contiguous,
    in order, sizes differing by at most one, together covering every item exactly once."""
    if not (of >= 1 and 0 <= index < of):
        raise ValueError(f"task index {index} of {of}: the index must be from 0 to {of - 1}")
    return total * index // of, total * (index + 1) // of


# What a file costs an intake task beyond its bytes (an open, a stat, a read call), in bytes of
# reading: it keeps a slicing of many small files (or zero-byte ones) balanced by count.
FILE_COST_BYTES = 16 * 1024
SLICING = "bytes-greedy-v1"  # in each intake record: a record of another slicing is not this task's


def balanced_slices(weights: Sequence[int], of: int) -> list[int]:
    """The intake task (0 .. ``of`` - 1) of each item: in the items' order, each goes to the task
    with the least weight so far (the lowest index among equals).

    Deterministic for the same weights and ``of``; every item in exactly one task; the tasks'
    weights differ by at most the largest item's. Contiguous ranges are not: the cost of a listing
    in name order is not uniform along it (a crawl's large images under one prefix), and with
    equal weights this is the stride ``i mod of``.
    """
    if of < 1:
        raise ValueError(f"{of} intake tasks: there must be at least one")
    if of == 1:
        return [0] * len(weights)
    heap = [(0, t) for t in range(of)]  # (weight so far, task): a valid heap as it stands
    owner = []
    for w in weights:
        load, task = heap[0]
        owner.append(task)
        heapq.heapreplace(heap, (load + w, task))
    return owner


@dataclass
class IntakeSlice:
    """What intake task ``index`` of ``of`` found: the outcome of every file of its samples."""

    outcomes: IntakeCache
    samples: int  # complete samples in the slice
    nbytes: int  # the bytes of the slice's files
    files_validated: int
    outcomes_reused: int


def intake_slice(
    store: SourceStore, source: str, index: int, of: int, *, trust_pickle: bool = False, num_workers: int = 1,
    validate: str = VALIDATE_FULL, cache: IntakeCache | None = None, progress=None,
) -> IntakeSlice:
    """Validate the files of slice ``index`` of ``of`` of the source's complete samples (in
    basename order, balanced by bytes: ``balanced_slices``), reading only those ``cache`` does
    not vouch for.

    The outcomes are an ``IntakeCache``: the plan's intake reads them as such, so the samples and
    the report it makes are those of one ``intake`` over the whole source, whatever the slicing.
    """
    check_validate_level(validate)
    slice_bounds(0, index, of)  # raises ValueError naming the range
    if cache is None or cache.level != validate:
        cache = IntakeCache(validate)
    listing = list_source(store, source)
    weights = listing.weights(FILE_COST_BYTES)
    mine = np.flatnonzero(np.asarray(balanced_slices(weights.tolist(), of), dtype=np.int64) == index)
    found = decide(store, source, listing, listing.complete.take(pa.array(mine)), cache=cache, level=validate,
                   trust_pickle=trust_pickle, num_workers=num_workers, progress=progress)
    nbytes = int(weights[mine].sum()) - FILE_COST_BYTES * len(listing.modalities) * len(mine)
    return IntakeSlice(found.used, len(mine), nbytes, found.files_validated, found.outcomes_reused)


def intake(
    store: SourceStore,
    source: str,
    *,
    classify_aspect_ratio: bool = True,
    trust_pickle: bool = False,
    num_workers: int = 1,
    progress=None,
    validate: str = VALIDATE_FULL,
    cache: IntakeCache | None = None,
) -> tuple[pa.Table, IntakeReport, IntakeCache]:
    """The samples table of ``source`` (sorted by key: ``plan.tables.samples_table``'s columns),
    a report of everything left out, and the intake cache of this run (pass it back as ``cache``
    next time: only new or changed files are read).

    ``validate``: ``full`` decodes every image, ``header`` reads sizes and EXIF from headers.
    """
    check_validate_level(validate)
    if cache is None or cache.level != validate:
        cache = IntakeCache(validate)
    listing = list_source(store, source)
    report = listing.report
    found = decide(store, source, listing, listing.complete, cache=cache, level=validate,
                   trust_pickle=trust_pickle, num_workers=num_workers, progress=progress)
    report.files_validated, report.outcomes_reused = found.files_validated, found.outcomes_reused
    kept, width, height, used, folders = listing.complete, found.width, found.height, found.used, listing.folders
    if found.reason.null_count != len(found.reason):  # some dropped: the others, not a copy of all
        encoded = pc.dictionary_encode(found.reason)
        codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
        note_codes(report, codes, encoded.dictionary.to_pylist(), flat(kept[BASENAME]))
        keep = pc.is_null(found.reason)
        kept, width, height = kept.filter(keep), pc.filter(width, keep), pc.filter(height, keep)
    del listing, found  # what the samples table does not share goes before it is made
    samples = keyed_samples(report, kept, report.modalities, folders, width, height,
                            classify_aspect_ratio=classify_aspect_ratio)
    report.samples = samples.num_rows
    if not samples.num_rows:
        # Building on would publish an empty version in place of the previous good build.
        reasons = dict(sorted((report.dropped + report.skipped_files).items()))
        raise NoSamplesError(
            f"source {source!r} at {store.uri}: no complete, valid sample (modalities {report.modalities}; "
            f"dropped or skipped: {reasons or 'none'}); nothing was written and earlier output is "
            "kept - fix the drop (every sample needs a valid file in each modality folder) and re-run"
        )
    return samples, report, used
