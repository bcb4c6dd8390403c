"""Intake: discover modality folders, intersect basenames, validate files, make keys safe.

Every file looked at ends up either in a sample or in the report with a reason.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from loader.formats.twin_tar import disambiguate_key, nearest_bucket, sanitize_key
from pid_platform.sharding.errors import NoModalitiesError, NoSamplesError
from pid_platform.sharding.intake.cache import CAPTION, IMAGE, SNIFF, FileOutcome, IntakeCache
from pid_platform.sharding.intake.file_checks import (
    CAPTION_EXTS,
    HEADER_BYTES,
    IMAGE_EXTS,
    PICKLE_SNIFF_BYTES,
    VALIDATE_FULL,
    VALIDATE_HEADER,
    check_caption,
    check_image,
    check_pickle,
    check_validate_level,
    ext_of,
    sniff_size,
    stem_of,
)
from pid_platform.sharding.parallel import chunked, ordered_map
from pid_platform.sharding.storage import FileEntry, SourceStore

MAX_EXAMPLES = 20
CHECK_CHUNK = 8  # samples per task of the validation workers


@dataclass(frozen=True)
class Sample:
    key: str  # WebDataset-safe, unique within the source
    basename: str  # original file stem shared by all modalities
    files: dict[str, FileEntry]  # modality -> file
    width: int | None = None
    height: int | None = None
    bucket: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass
class IntakeReport:
    source: str
    modalities: list[str] = field(default_factory=list)
    empty_modalities: list[str] = field(default_factory=list)
    image_modality: str | None = None
    files_seen: dict[str, int] = field(default_factory=dict)
    orphans: dict[str, int] = field(default_factory=dict)  # modality -> files without partners
    skipped_files: Counter = field(default_factory=Counter)  # reason -> files
    dropped: Counter = field(default_factory=Counter)  # reason -> samples
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first few names
    key_collisions: int = 0
    samples: int = 0
    # How the outcomes were found (not part of the report's JSON: a rebuild of the same source
    # reports the same JSON whatever it had to validate again).
    files_validated: int = 0  # checked this run
    outcomes_reused: int = 0  # taken from the intake cache (file identity unchanged)

    def note(self, reason: str, what: str, counter: Counter | None = None) -> None:
        (self.dropped if counter is None else counter)[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(what)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "modalities": self.modalities,
            "empty_modalities": self.empty_modalities,
            "image_modality": self.image_modality,
            "files_seen": self.files_seen,
            "orphans": self.orphans,
            "skipped_files": dict(sorted(self.skipped_files.items())),
            "dropped": dict(sorted(self.dropped.items())),
            "dropped_total": self.dropped_total,
            "examples": {k: v for k, v in sorted(self.examples.items())},
            "key_collisions": self.key_collisions,
            "samples": self.samples,
        }


def _pick_image_modality(modalities: list[str], listings: dict[str, list[FileEntry]]) -> str | None:
    if "image" in listings:
        return "image"
    for m in modalities:
        if listings[m] and all(ext_of(e.name) in IMAGE_EXTS for e in listings[m][:64]):
            return m
    return None


@dataclass(frozen=True)
class _Checked:
    reason: str | None
    width: int | None = None
    height: int | None = None


class _NeedsCheck(Exception):
    """A file's outcome is not cached: the sample goes to the workers."""


def _kind(modality: str, name: str, image_modality: str | None) -> str | None:
    """What a file is checked as; None: a file in the image modality that is not an image."""
    ext = ext_of(name)
    if ext in IMAGE_EXTS:
        return IMAGE
    if modality == image_modality:
        return None
    return CAPTION if ext in CAPTION_EXTS else SNIFF


def _sample_outcome(files: dict[str, FileEntry], image_modality: str | None, trust_pickle: bool,
                    outcome_of) -> _Checked:
    """A sample's files, modality by modality in name order; the first failure is its reason.

    ``outcome_of(entry, kind)`` gives a file's ``FileOutcome`` (from the cache, or checked).
    """
    image: FileOutcome | None = None
    for modality, entry in sorted(files.items()):
        if entry.size == 0:
            return _Checked(f"zero_byte: {modality}")
        kind = _kind(modality, entry.name, image_modality)
        if kind is None:
            return _Checked(f"not_an_image: {modality}")
        if kind == SNIFF and trust_pickle:
            continue  # embeddings are only sniffed for pickle: trusted data is not read at all
        outcome = outcome_of(entry, kind)
        if outcome.reason is not None:
            return _Checked(f"{outcome.reason}: {modality}")
        if modality == image_modality:
            image = outcome
    if image is None:
        return _Checked(None)
    return _Checked(None, image.width, image.height)


def check_file(store: SourceStore, source: str, entry: FileEntry, kind: str, level: str,
               trust_pickle: bool) -> FileOutcome:
    """Read and check one file (raises ``UnsafeInputError`` for pickle data unless trusted)."""
    if kind == SNIFF:
        head = store.read_head(source, entry, PICKLE_SNIFF_BYTES)
        if sniff_size(head) > len(head):  # a long .npy header: parse all of it
            head = store.read_head(source, entry, sniff_size(head))
        check_pickle(entry.name, head, store.describe(source, entry), trust_pickle)
        return FileOutcome(SNIFF)
    if kind == CAPTION:
        reason = check_caption(store.read(source, entry), ext_of(entry.name))
        return FileOutcome(CAPTION, None if reason is None else reason.split(":", 1)[0])
    if level == VALIDATE_HEADER and entry.size > HEADER_BYTES:
        res = check_image(store.read_head(source, entry, HEADER_BYTES), VALIDATE_HEADER)
        if isinstance(res, str):  # a header longer than the head (a large EXIF or ICC block)
            res = check_image(store.read(source, entry), VALIDATE_HEADER)
    else:
        res = check_image(store.read(source, entry), level)
    if isinstance(res, str):
        return FileOutcome(IMAGE, res.split(":", 1)[0])
    return FileOutcome(IMAGE, None, res.width, res.height)


def _cached_only(hits: dict[str, FileOutcome]):
    def outcome_of(entry: FileEntry, kind: str) -> FileOutcome:
        hit = hits.get(entry.modality)
        if hit is None or hit.kind != kind:
            raise _NeedsCheck
        return hit

    return outcome_of


def _checking(store: SourceStore, source: str, level: str, trust_pickle: bool, known: dict[str, FileOutcome],
              fresh: list[tuple[FileEntry, FileOutcome]]):
    def outcome_of(entry: FileEntry, kind: str) -> FileOutcome:
        hit = known.get(entry.modality)
        if hit is not None and hit.kind == kind:
            return hit
        res = check_file(store, source, entry, kind, level, trust_pickle)
        fresh.append((entry, res))
        return res

    return outcome_of


def _check_chunk(args) -> list[tuple[_Checked, list[tuple[FileEntry, FileOutcome]]]]:
    """Worker: each sample's outcome, and the outcomes of the files it checked."""
    store, source, image_modality, trust_pickle, level, chunk = args
    out = []
    for files, known in chunk:
        fresh: list[tuple[FileEntry, FileOutcome]] = []
        outcome_of = _checking(store, source, level, trust_pickle, known, fresh)
        out.append((_sample_outcome(files, image_modality, trust_pickle, outcome_of), fresh))
    return out


def _check_all(
    store: SourceStore, source: str, complete: list[dict[str, FileEntry]], image_modality: str | None, *,
    trust_pickle: bool, level: str, cache: IntakeCache, num_workers: int, progress, report: IntakeReport,
) -> tuple[list[_Checked], IntakeCache]:
    """The outcome of every complete sample, validating only files the cache does not vouch for.

    Returns the outcomes and the cache of this run: every file outcome it used (a file no
    longer listed leaves the set).
    """
    used = IntakeCache(level)
    known: list[dict[str, FileOutcome]] = []  # per sample: the cached outcomes of its files
    for files in complete:
        hits = {}
        for m, entry in files.items():
            kind = _kind(m, entry.name, image_modality)
            hit = None if kind is None else cache.get(entry, kind)
            if hit is not None:
                hits[m] = hit
                used.put(entry, hit)  # still valid: it goes on to the next build, used or not
        report.outcomes_reused += len(hits)
        known.append(hits)

    checked: list[_Checked | None] = []
    pending: list[int] = []
    for i, files in enumerate(complete):
        try:
            checked.append(_sample_outcome(files, image_modality, trust_pickle, _cached_only(known[i])))
        except _NeedsCheck:
            checked.append(None)
            pending.append(i)

    # Small chunks: a chunk of full decodes costs about 4 ms per sample, and the workers all
    # wait for the last one; 8 samples keep that tail short, and a thread needs no batching.
    chunks = chunked([(complete[i], known[i]) for i in pending], CHECK_CHUNK)
    tasks = [(store, source, image_modality, trust_pickle, level, c) for c in chunks]
    slots = iter(pending)
    # Threads: Pillow decodes without the GIL, and no worker process has to start (seconds on a
    # busy machine) or unpickle the store for each chunk.
    for res in ordered_map(_check_chunk, tasks, num_workers, threads=True):
        for chk, fresh in res:
            checked[next(slots)] = chk
            for entry, outcome in fresh:
                used.put(entry, outcome)
            report.files_validated += len(fresh)
        if progress is not None:
            progress(len(res))
    return checked, used  # type: ignore[return-value]


@dataclass
class Listing:
    """What the listing of a source decides before any file is read: the modalities, the
    report's listing part, and the complete samples (basename and files) in basename order,
    the stable order intake tasks are cut from (``balanced_slices``)."""

    report: IntakeReport
    complete: list[tuple[str, dict[str, FileEntry]]]


def list_source(store: SourceStore, source: str) -> Listing:
    """List ``source``: modality folders, basename intersection and every file left out with
    its reason (``IntakeReport`` without validation outcomes)."""
    report = IntakeReport(source)
    modalities = store.list_modalities(source)
    listings: dict[str, list[FileEntry]] = {}
    for m in modalities:
        listing = store.list_files(source, m)
        for rel, reason in listing.skipped:
            report.note(reason, rel, report.skipped_files)
        if listing.duplicate_of is not None:
            continue  # a link to another modality folder: its files are read once, there
        report.files_seen[m] = len(listing.entries)
        if listing.entries:
            listings[m] = listing.entries
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

    by_stem: dict[str, dict[str, FileEntry]] = defaultdict(dict)
    ambiguous: set[str] = set()
    for m in active:
        for e in listings[m]:
            stem = stem_of(e.name)
            if m in by_stem[stem]:
                ambiguous.add(stem)
            by_stem[stem][m] = e
    for stem in sorted(ambiguous):
        report.note("ambiguous_basename", stem)  # x.jpg and x.png in one folder: no safe choice
    orphans: Counter = Counter()
    complete: list[tuple[str, dict[str, FileEntry]]] = []
    for stem in sorted(by_stem):
        files = by_stem[stem]
        if stem in ambiguous:
            continue
        if len(files) == len(active):
            complete.append((stem, files))
            continue
        missing = [m for m in active if m not in files]
        for m in files:
            orphans[m] += 1
        report.note(f"missing_modality: {','.join(missing)}", stem)
    report.orphans = {m: orphans.get(m, 0) for m in active}
    return Listing(report, complete)


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


def sample_weight(files: dict[str, FileEntry]) -> int:
    """What validating a sample costs, in bytes read: its files' sizes plus a fixed cost per file.

    Bytes stand for the decode cost (a full decode of a photograph is about linear in its file
    size, far more than in its count), and are known from the listing before anything is read.
    """
    return sum(e.size for e in files.values()) + FILE_COST_BYTES * len(files)


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
    weights = [sample_weight(files) for _, files in listing.complete]
    owner = balanced_slices(weights, of)
    mine = [i for i, t in enumerate(owner) if t == index]
    report = listing.report
    _checked, used = _check_all(
        store, source, [listing.complete[i][1] for i in mine], report.image_modality, trust_pickle=trust_pickle,
        level=validate, cache=cache, num_workers=num_workers, progress=progress, report=report,
    )
    nbytes = sum(e.size for i in mine for e in listing.complete[i][1].values())
    return IntakeSlice(used, len(mine), nbytes, report.files_validated, report.outcomes_reused)


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
) -> tuple[list[Sample], IntakeReport, IntakeCache]:
    """Samples of ``source`` (sorted by key), a report of everything left out, and the intake
    cache of this run (pass it back as ``cache`` next time: only new or changed files are read).

    ``validate``: ``full`` decodes every image, ``header`` reads sizes and EXIF from headers.
    """
    check_validate_level(validate)
    if cache is None or cache.level != validate:
        cache = IntakeCache(validate)
    listing = list_source(store, source)
    report, complete = listing.report, listing.complete

    checked, used = _check_all(
        store, source, [files for _, files in complete], report.image_modality, trust_pickle=trust_pickle,
        level=validate, cache=cache, num_workers=num_workers, progress=progress, report=report,
    )

    keys: dict[str, list[str]] = defaultdict(list)
    good: list[tuple[str, dict[str, FileEntry], _Checked]] = []
    for (stem, files), chk in zip(complete, checked, strict=True):
        if chk.reason is not None:
            report.note(chk.reason, stem)
            continue
        good.append((stem, files, chk))
        keys[sanitize_key(stem)].append(stem)
    colliding = {k for k, stems in keys.items() if len(stems) > 1}
    report.key_collisions = sum(len(keys[k]) for k in colliding)

    samples: list[Sample] = []
    for stem, files, chk in good:
        key = sanitize_key(stem)
        if key in colliding:
            # Two names that sanitise alike both keep their data under distinct, stable keys.
            key = disambiguate_key(key, stem)
            renamed = report.examples.setdefault("key_collision_renamed", [])
            if len(renamed) < MAX_EXAMPLES:  # the count is key_collisions; these are examples
                renamed.append(f"{stem} -> {key}")
        bucket = None
        if classify_aspect_ratio and chk.width:
            bucket = nearest_bucket(chk.width, chk.height)
        samples.append(Sample(key, stem, files, chk.width, chk.height, bucket))
    samples.sort(key=lambda s: s.key)
    dup = [k for k, n in Counter(s.key for s in samples).items() if n > 1]
    if dup:  # only if a digest suffix collided with a natural key: astronomically rare
        raise RuntimeError(f"source {source!r}: keys still collide after disambiguation: {dup[:5]}")
    report.samples = len(samples)
    if not samples:
        # Building on would publish an empty version in place of the previous good build.
        reasons = dict(sorted((report.dropped + report.skipped_files).items()))
        raise NoSamplesError(
            f"source {source!r} at {store.uri}: no complete, valid sample (modalities {report.modalities}; "
            f"dropped or skipped: {reasons or 'none'}); nothing was written and earlier output is "
            "kept - fix the drop (every sample needs a valid file in each modality folder) and re-run"
        )
    return samples, report, used

