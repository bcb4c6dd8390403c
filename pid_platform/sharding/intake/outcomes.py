"""Each complete sample's outcome: valid (with its image's size) or the reason it is dropped.

A sample's files are taken modality by modality in name order, and the first failure is its
reason. Outcomes the intake cache holds for a file's current identity are used as they are,
decided for a whole column of samples at once; only the samples with a file the cache does not
vouch for are made objects and read, on threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pid_platform.sharding.compute import pc
from pid_platform.sharding.intake.cache import (
    CACHE_SCHEMA,
    CAPTION,
    IMAGE,
    SNIFF,
    FileOutcome,
    IntakeCache,
    content_hash,
    content_identities,
    hashed_bytes,
)
from pid_platform.sharding.intake.file_checks import (
    CAPTION_EXTS,
    HEADER_BYTES,
    IMAGE_EXTS,
    PICKLE_SNIFF_BYTES,
    VALIDATE_HEADER,
    check_caption,
    check_image,
    check_pickle,
    ext_of,
    sniff_size,
)
from pid_platform.sharding.intake.listing import SourceListing, flat, raw_extensions
from pid_platform.sharding.parallel import chunked, ordered_map
from pid_platform.sharding.storage import FileEntry, SourceStore

CHECK_CHUNK = 8  # samples per task of the validation workers
KINDS = (IMAGE, CAPTION, SNIFF)  # a file's kind code is its position here; -1: not an image


def kind_of(modality: str, name: str, image_modality: str | None) -> str | None:
    """What a file is checked as; None: a file in the image modality that is not an image."""
    ext = ext_of(name)
    if ext in IMAGE_EXTS:
        return IMAGE
    if modality == image_modality:
        return None
    return CAPTION if ext in CAPTION_EXTS else SNIFF


def kind_codes(modality: str, names: pa.Array, image_modality: str | None) -> np.ndarray:
    """``kind_of`` of every name, as positions in ``KINDS`` (-1: not an image), decided once per
    distinct extension."""
    raw = flat(raw_extensions(names))
    encoded = pc.dictionary_encode(raw)
    per_ext = [kind_of(modality, f"x.{e}" if e else "x", image_modality) for e in encoded.dictionary.to_pylist()]
    lut = np.array([-1 if k is None else KINDS.index(k) for k in per_ext], dtype=np.int8)
    return lut[encoded.indices.to_numpy(zero_copy_only=False)] if len(lut) else np.zeros(0, np.int8)


def check_file(store: SourceStore, source: str, entry: FileEntry, kind: str, level: str) -> FileOutcome:
    """Read and check one file (raises ``UnsafeInputError`` for pickle data)."""
    if kind == SNIFF:
        head = store.read(source, entry, PICKLE_SNIFF_BYTES)
        if sniff_size(head) > len(head):  # a long .npy header: parse all of it
            head = store.read(source, entry, sniff_size(head))
        check_pickle(entry.name, head, store.describe(source, entry))
        # The outcome depends on these bytes only: their hash settles a later doubt.
        return FileOutcome(SNIFF, sha256=content_hash(head))
    if kind == CAPTION:
        data = store.read(source, entry)
        reason = check_caption(data, ext_of(entry.name))
        return FileOutcome(CAPTION, None if reason is None else reason.split(":", 1)[0], sha256=content_hash(data))
    head = level == VALIDATE_HEADER and entry.size > HEADER_BYTES
    data = store.read(source, entry, HEADER_BYTES if head else None)
    res = check_image(data, level)
    if head and isinstance(res, str):  # a header longer than the head (a large EXIF or ICC block)
        data = store.read(source, entry)
        res = check_image(data, level)
    if isinstance(res, str):
        return FileOutcome(IMAGE, res.split(":", 1)[0], sha256=content_hash(data))
    return FileOutcome(IMAGE, None, res.width, res.height, content_hash(data))


# A sample's drop reason (None: valid) and, for a valid one, its image's outcome (None without one).
SampleOutcome = tuple[str | None, FileOutcome | None]


def sample_outcome(files: dict[str, FileEntry], image_modality: str | None, trust_pickle: bool,
                   outcome_of) -> SampleOutcome:
    """A sample's files, modality by modality in name order; the first failure is its reason.

    ``outcome_of(entry, kind)`` gives a file's ``FileOutcome`` (from the cache, or checked).
    """
    image: FileOutcome | None = None
    for modality, entry in sorted(files.items()):
        if entry.size == 0:
            return f"zero_byte: {modality}", None
        kind = kind_of(modality, entry.name, image_modality)
        if kind is None:
            return f"not_an_image: {modality}", None
        if kind == SNIFF and trust_pickle:
            continue  # embeddings are only sniffed for pickle: trusted data is not read at all
        outcome = outcome_of(entry, kind)
        if outcome.reason is not None:
            return f"{outcome.reason}: {modality}", None
        if modality == image_modality:
            image = outcome
    return None, image


def _check_chunk(args) -> list[tuple[SampleOutcome, list[tuple[FileEntry, FileOutcome]]]]:
    """Worker: each sample's outcome (``sample_outcome``), and the outcomes of the files it checked."""
    store, source, image_modality, trust_pickle, level, chunk = args
    out = []
    for files, known in chunk:
        fresh: list[tuple[FileEntry, FileOutcome]] = []

        def outcome_of(entry: FileEntry, kind: str, known=known, fresh=fresh) -> FileOutcome:
            hit = known.get(entry.modality)
            if hit is not None and hit.kind == kind:
                return hit
            res = check_file(store, source, entry, kind, level)
            fresh.append((entry, res))
            return res

        out.append((sample_outcome(files, image_modality, trust_pickle, outcome_of), fresh))
    return out


@dataclass
class Outcomes:
    """The outcome of each row of a table of complete samples, and the cache of this run."""

    reason: pa.Array  # string; null: the sample is valid
    width: pa.Array  # int32; the image modality's size (null without one)
    height: pa.Array
    used: IntakeCache  # every outcome this run used or found, for the next build
    files_validated: int  # files read this run
    outcomes_reused: int  # files whose outcome came from the cache


def _hits(cache: IntakeCache, modality: str, rows: pa.Table, kinds: np.ndarray,
          ) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """The cached outcome of each row's file of ``modality``, whether it applies (the same file
    identity, checked as the same kind), and whether it is in doubt: checked as the same kind,
    the same size and mtime, but another ctime or inode (a chmod, chown, hard link or restore),
    with a hash of the bytes to settle it."""
    held = cache.lookup(modality, flat(rows[f"name.{modality}"]))
    wanted = pa.array([None, *KINDS], pa.string()).take(pa.array(kinds.astype(np.int64) + 1))  # -1: None
    same_kind = pc.equal(held["kind"], wanted)
    listed = rows[f"fingerprint.{modality}"]
    applies = pc.fill_null(pc.and_(pc.equal(held["fingerprint"], listed), same_kind), False)
    doubt = pc.and_(pc.and_(pc.invert(applies), same_kind), pc.is_valid(held["sha256"]))
    doubt = pc.and_(doubt, pc.equal(content_identities(held["fingerprint"]), content_identities(listed)))
    return (held, applies.to_numpy(zero_copy_only=False),
            pc.fill_null(doubt, False).to_numpy(zero_copy_only=False))


def _hash_chunk(args) -> list[str | None]:
    """Worker: the content hash of the bytes each file's cached outcome was found for (as many
    as its check read: ``content_hash``), read again, never decoded."""
    store, source, pairs = args
    out: list[str | None] = []
    for entry, kept in pairs:
        n = hashed_bytes(kept)
        out.append(None if n is None else content_hash(store.read(source, entry, n)))
    return out


def _same_bytes(store: SourceStore, source: str, listing: SourceListing, modality: str, rows: pa.Table,
                held: pa.Table, doubt: np.ndarray, num_workers: int) -> np.ndarray:
    """Which files in doubt still hold the bytes their cached outcome was found for (by hash)."""
    same = np.zeros(len(doubt), dtype=bool)
    todo = np.flatnonzero(doubt)
    if not len(todo):
        return same
    entries = [files[modality] for files in listing.entries(rows.take(pa.array(todo)))]
    kept = held["sha256"].take(pa.array(todo)).to_pylist()
    chunks = [(store, source, c) for c in chunked(list(zip(entries, kept, strict=True)), CHECK_CHUNK)]
    hashes = [h for part in ordered_map(_hash_chunk, chunks, num_workers, threads=True) for h in part]
    same[todo] = [a is not None and a == b for a, b in zip(hashes, kept, strict=True)]
    return same


def _still_valid(modality: str, rows: pa.Table, outcomes: pa.Table, applies: np.ndarray) -> pa.Table:
    """The cached outcomes that apply to ``rows``' files of ``modality``, as cache rows; when all
    do, the columns are the rows' and the cache's own (no copy of ten million names)."""
    every = bool(applies.all())
    mask = None if every else pa.array(applies)

    def pick(column):
        return column if every else pc.filter(column, mask)

    return pa.table({
        "modality": pa.repeat(pa.scalar(modality, pa.string()), int(applies.sum())),
        "name": pick(rows[f"name.{modality}"]), "fingerprint": pick(rows[f"fingerprint.{modality}"]),
        **{c: pick(outcomes[c]) for c in ("kind", "reason", "width", "height", "sha256")},
    })


def decide(
    store: SourceStore, source: str, listing: SourceListing, rows: pa.Table, *, cache: IntakeCache, level: str,
    trust_pickle: bool, num_workers: int, progress=None,
) -> Outcomes:
    """The outcome of every sample in ``rows`` (rows of ``listing.complete``), validating only
    files ``cache`` does not vouch for. The cache of this run holds every outcome it used, so a
    file no longer listed leaves it."""
    n = rows.num_rows
    image_modality = listing.report.image_modality
    used = IntakeCache(cache.level)
    reason = np.full(n, None, dtype=object)
    decided = np.zeros(n, dtype=bool)
    pending = np.zeros(n, dtype=bool)
    width = np.zeros(n, dtype=np.int64)
    height = np.zeros(n, dtype=np.int64)
    sized = np.zeros(n, dtype=bool)
    held: dict[str, tuple[pa.Table, np.ndarray]] = {}
    reused = 0
    for m in listing.modalities:
        kinds = kind_codes(m, flat(rows[f"name.{m}"]), image_modality)
        outcomes, applies, doubt = _hits(cache, m, rows, kinds)
        # A chmod, chown, hard link or restore moves only ctime or inode: a read settles it, not a decode.
        applies |= _same_bytes(store, source, listing, m, rows, outcomes, doubt, num_workers)
        # What a pending sample's check may reuse (the fingerprints matched: they are the rows').
        held[m] = (outcomes.select(["kind", "reason", "width", "height", "sha256"]), applies)
        reused += int(applies.sum())
        used.add(_still_valid(m, rows, outcomes, applies))  # it goes on to the next build, used or not
        sizes = rows[f"size.{m}"].to_numpy()
        open_ = ~decided & ~pending
        for cond, label in ((sizes == 0, f"zero_byte: {m}"), (kinds < 0, f"not_an_image: {m}")):
            hit = open_ & cond
            reason[hit] = label
            decided |= hit
            open_ &= ~cond
        if trust_pickle:
            open_ &= kinds != KINDS.index(SNIFF)  # trusted embeddings are not read at all
        pending |= open_ & ~applies
        open_ &= applies
        bad = open_ & pc.is_valid(outcomes["reason"]).to_numpy(zero_copy_only=False)
        reason[bad] = [f"{r}: {m}" for r in pc.filter(outcomes["reason"], pa.array(bad)).to_pylist()]
        decided |= bad
        if m == image_modality:
            good = open_ & ~bad
            width[good] = pc.fill_null(outcomes["width"], 0).to_numpy(zero_copy_only=False)[good]
            height[good] = pc.fill_null(outcomes["height"], 0).to_numpy(zero_copy_only=False)[good]
            sized |= good & pc.is_valid(outcomes["width"]).to_numpy(zero_copy_only=False)
    cache.release()  # the last modality's cached rows: what applied is in ``used`` and ``held``

    checked: list[tuple] = []  # the cache rows of the files read this run
    todo = np.flatnonzero(pending)
    if len(todo):
        sub = rows.take(pa.array(todo))
        samples = listing.entries(sub)
        known = []
        for j, i in enumerate(todo):
            hits = {}
            for m in listing.modalities:
                outcomes, applies = held[m]
                if applies[i]:
                    hits[m] = FileOutcome(**outcomes.slice(int(i), 1).to_pylist()[0])
            known.append((samples[j], hits))
        # Small chunks: a chunk of full decodes costs about 4 ms per sample, and the workers all
        # wait for the last one; 8 samples keep that tail short, and a thread needs no batching.
        tasks = [(store, source, image_modality, trust_pickle, level, c) for c in chunked(known, CHECK_CHUNK)]
        slots = iter(todo)
        # Threads: Pillow decodes without the GIL, and no worker process has to start (seconds on a
        # busy machine) or unpickle the store for each chunk.
        for res in ordered_map(_check_chunk, tasks, num_workers, threads=True):
            for (why, image), fresh in res:
                i = next(slots)
                reason[i], sized[i] = why, image is not None and image.width is not None
                if sized[i]:
                    width[i], height[i] = image.width, image.height
                checked += [(e.modality, e.name, e.fingerprint, o.kind, o.reason, o.width, o.height, o.sha256)
                            for e, o in fresh]
            if progress is not None:
                progress(len(res))
        used.add(pa.Table.from_struct_array(pa.array(checked, pa.struct(CACHE_SCHEMA))))
    reasons = pa.array(reason, pa.string())
    unsized = ~(sized & pc.is_null(reasons).to_numpy(zero_copy_only=False))  # no size kept for a dropped one
    return Outcomes(reasons, pa.array(width, pa.int32(), mask=unsized), pa.array(height, pa.int32(), mask=unsized),
                    used, files_validated=len(checked), outcomes_reused=reused)


