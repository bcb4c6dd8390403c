"""Reader options and counts, and the webdataset-style stages over the sample reader.

``ExpandOptions`` (zip or index mode, missing-key, shard-error and verify policies) and
``ExpandStats`` (every drop counted) configure ``twin_reader.TwinReader``, which the dataset
uses. ``url_opener -> tar_file_expander -> process_sample -> group_by_keys`` are the same read
as PiD's generator stages (members out, renamed ``<key>.<modality>.<ext>``, regrouped into
samples, an end-of-shard marker between shards) for code composed that way.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loader.io.config import StreamStats
from loader.wds.epoch_plan import Task

log = logging.getLogger(__name__)

EOS = {"__eos__": True}  # end-of-shard marker
MISSING_POLICIES = ("skip", "error", "partial")
DECODE_ERROR_POLICIES = ("raise", "skip")
MAX_KEYS_KEPT = 1000  # keys listed per counter in the stats; the count itself is exact


@dataclass
class ExpandStats:
    """Counts a training job can log; nothing is dropped without being counted here."""

    samples: int = 0
    shards: int = 0
    missing_keys: Counter = field(default_factory=Counter)  # modality -> keys skipped or partial
    duplicates: int = 0
    unindexed_members: int = 0
    escaping_keys: int = 0  # keys of PiD-written tars that are paths out of a folder ('../x', '/abs')
    shard_errors: int = 0
    zip_fallbacks: int = 0
    decode_errors: int = 0  # samples skipped under on_decode_error="skip"
    decode_error_keys: Counter = field(default_factory=Counter)  # their keys (the first MAX_KEYS_KEPT)
    stream: StreamStats = field(default_factory=StreamStats)  # remote reads: bytes, retries...
    samples_per_source: Counter = field(default_factory=Counter)  # a mixture's samples read, by source

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.as_dict(),
            "samples": self.samples, "shards": self.shards, "missing_keys": dict(self.missing_keys),
            "duplicates": self.duplicates, "unindexed_members": self.unindexed_members,
            "escaping_keys": self.escaping_keys,
            "shard_errors": self.shard_errors, "zip_fallbacks": self.zip_fallbacks,
            "decode_errors": self.decode_errors, "decode_error_keys": dict(self.decode_error_keys),
            "samples_per_source": dict(self.samples_per_source),
        }

    def note_decode_error(self, key: str) -> None:
        self.decode_errors += 1
        if key in self.decode_error_keys or len(self.decode_error_keys) < MAX_KEYS_KEPT:
            self.decode_error_keys[key] += 1


@dataclass(frozen=True)
class ExpandOptions:
    mode: str = "zip"  # "zip" | "index"
    missing_key_policy: str = "skip"
    zip_fallback_to_index: bool = False
    lookahead: int = 1024  # index mode: members read ahead per modality while looking for a key
    shard_error_policy: str = "raise"  # "raise" | "skip"
    stream_config: Any = None
    verify: str | None = None  # "sha256": hash each tar whole while streaming, against its manifest

    def __post_init__(self) -> None:
        if self.mode not in ("zip", "index"):
            raise ValueError(f"mode must be 'zip' or 'index', got {self.mode!r}")
        if self.missing_key_policy not in MISSING_POLICIES:
            raise ValueError(f"missing_key_policy must be one of {MISSING_POLICIES}, got {self.missing_key_policy!r}")
        if self.shard_error_policy not in ("raise", "skip"):
            raise ValueError(f"shard_error_policy must be 'raise' or 'skip', got {self.shard_error_policy!r}")
        if self.verify not in (None, "sha256"):
            raise ValueError(f"verify must be None or 'sha256', got {self.verify!r}")


def url_opener(tasks: Iterable[tuple[int, Task]], shards) -> Iterator[dict]:
    """Attach the shard description to each task (streams open lazily, one per modality)."""
    for epoch, task in tasks:
        yield {"epoch": epoch, "task": task, "shard": shards[task.shard_id]}


def tar_file_expander(opened: Iterable[dict], modalities: tuple[str, ...] | None, opts: ExpandOptions,
                      stats: ExpandStats) -> Iterator[dict]:
    """Members (``{"key", "modality", "ext", "data", "index", ...}``), then an end-of-shard marker,
    for each ``url_opener`` item: the webdataset-style stage, over the sample reader
    (``twin_reader.TwinReader``, which the dataset uses directly)."""
    from loader.wds.twin_reader import TwinReader

    reader = TwinReader(None, modalities, opts, stats)
    try:
        for item in opened:
            reader.shards = {item["task"].shard_id: item["shard"]}
            for s in reader.samples(item["epoch"], item["task"]):
                where = {"index": s["__index__"], "epoch": s["__epoch__"], "shard_id": s["__shard__"],
                         "pad": s["__pad__"], "bucket": s["__bucket__"]}
                for f, data in s.items():
                    if not f.startswith("__"):
                        modality, _, ext = f.partition(".")
                        yield {"key": s["__key__"], "modality": modality, "ext": ext, "data": data, **where}
                if "__missing__" in s:
                    yield {"key": s["__key__"], "modality": None, "ext": "", "data": b"",
                           "missing": s["__missing__"], **where}
            yield EOS
    finally:
        reader.close()


def process_sample(member: dict) -> dict:
    """Tag a member with its modality: ``id_0.jpg`` from ``image/`` becomes ``id_0.image.jpg``."""
    if member is EOS or member.get("modality") is None:
        return member
    ext = member["ext"]
    member["fname"] = f"{member['key']}.{member['modality']}.{ext}" if ext else f"{member['key']}.{member['modality']}"
    return member


def group_by_keys(members: Iterable[dict], stats: ExpandStats | None = None) -> Iterator[dict]:
    """Consecutive members with one key become one sample ``{"__key__", "image.jpg", ...}``
    (``stats`` is not needed: the reader behind ``tar_file_expander`` counts the samples)."""
    current: dict | None = None
    for m in members:
        if m is EOS or (current is not None and m["key"] != current["__key__"]) or (
            current is not None and m["index"] != current["__index__"]
        ):
            if current is not None:
                yield current
                current = None
            if m is EOS:
                continue
        if current is None:
            current = {
                "__key__": m["key"], "__shard__": m["shard_id"], "__index__": m["index"],
                "__epoch__": m["epoch"], "__pad__": m["pad"], "__bucket__": m["bucket"],
            }
        if m.get("modality") is None:
            current["__missing__"] = m["missing"]
            continue
        suffix = m["fname"][len(m["key"]) + 1 :]  # "<modality>.<ext>"
        current[suffix] = m["data"]
    if current is not None:
        yield current
