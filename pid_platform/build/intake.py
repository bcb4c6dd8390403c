"""Intake: discover modality folders, intersect basenames, validate files, make keys safe.

Every file looked at ends up either in a sample or in the report with a reason.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from loader.formats.twin_tar import disambiguate_key, nearest_bucket, sanitize_key
from pid_platform.build.errors import NoModalitiesError, NoSamplesError
from pid_platform.build.parallel import chunked, ordered_map
from pid_platform.build.storage import FileEntry, SourceStore
from pid_platform.build.validate import (
    CAPTION_EXTS,
    IMAGE_EXTS,
    PICKLE_SNIFF_BYTES,
    ImageInfo,
    check_caption,
    check_image,
    check_pickle,
    ext_of,
    sniff_size,
    stem_of,
)

MAX_EXAMPLES = 20


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


def _check_one(
    store: SourceStore, source: str, image_modality: str | None, trust_pickle: bool,
    files: dict[str, FileEntry],
) -> _Checked:
    info: ImageInfo | None = None
    for modality, entry in sorted(files.items()):
        if entry.size == 0:
            return _Checked(f"zero_byte: {modality}")
        ext = ext_of(entry.name)
        is_image = ext in IMAGE_EXTS
        is_caption = ext in CAPTION_EXTS and modality != image_modality
        if not (is_image or is_caption) and modality != image_modality:
            if not trust_pickle:  # embeddings are only sniffed: their head says whether it is pickle
                head = store.read_head(source, entry, PICKLE_SNIFF_BYTES)
                if sniff_size(head) > len(head):  # a long .npy header: parse all of it
                    head = store.read_head(source, entry, sniff_size(head))
                check_pickle(entry.name, head, store.describe(source, entry), trust_pickle)
            continue
        data = store.read(source, entry)
        if is_image:
            res = check_image(data)
            if isinstance(res, str):
                return _Checked(res.split(":", 1)[0] + f": {modality}")
            if modality == image_modality:
                info = res
        elif modality == image_modality:
            return _Checked(f"not_an_image: {modality}")
        elif is_caption:
            reason = check_caption(data, ext)
            if reason:
                return _Checked(reason.split(":", 1)[0] + f": {modality}")
    if info is None:
        return _Checked(None)
    return _Checked(None, info.width, info.height)


def _check_chunk(args) -> list[_Checked]:
    store, source, image_modality, trust_pickle, chunk = args
    return [_check_one(store, source, image_modality, trust_pickle, files) for files in chunk]


def intake(
    store: SourceStore,
    source: str,
    *,
    classify_aspect_ratio: bool = True,
    trust_pickle: bool = False,
    num_workers: int = 1,
    progress=None,
) -> tuple[list[Sample], IntakeReport]:
    """Samples of ``source`` (sorted by key) and a report of everything left out."""
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

    chunks = chunked([files for _, files in complete], 64)
    tasks = [(store, source, report.image_modality, trust_pickle, c) for c in chunks]
    checked: list[_Checked] = []
    for res in ordered_map(_check_chunk, tasks, num_workers):
        checked.extend(res)
        if progress is not None:
            progress(len(res))

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
            f"source {source!r} at {store.uri}: no complete, valid sample (modalities {active}; "
            f"dropped or skipped: {reasons or 'none'}); nothing was written and earlier output is "
            "kept - fix the drop (every sample needs a valid file in each modality folder) and re-run"
        )
    return samples, report

