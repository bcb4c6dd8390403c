"""Shard planning: group each bucket's samples into size- or count-bounded shards.

The bound is on the exact bytes the shard's tars occupy, all modalities together (headers,
padding and end-of-archive included), so "every tar respects the bound" is checkable on disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import random
from collections import defaultdict
from dataclasses import dataclass

from loader.formats.errors import short_repr
from loader.formats.twin_tar import (
    DEFAULT_PART_SIZE,
    END_OF_ARCHIVE,
    RECORD,
    member_name,
    member_span,
    sanitize_ext,
    shard_relpath,
    tar_size,
)
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.intake.task import Sample

FLAT = ""  # bucket name used in flat mode (no aspect-ratio folders)
MIN_SHARD_SIZE_MB = 1 / 1024  # 1 KiB: below a tar record every sample is a shard of its own anyway
MAX_SHARD_SIZE_MB = 1024 * 1024  # 1 TiB per shard
MAX_COUNT = 2**31 - 1  # samples per shard, tars per part folder: what a Dagster (GraphQL) Int holds
PLAN_VERSION = 1


@dataclass(frozen=True)
class ShardingConfig:
    max_shard_size_mb: float = 500.0
    shard_size: int = 0  # > 0: fixed samples per shard instead of the byte bound
    part_size: int = DEFAULT_PART_SIZE
    classify_aspect_ratio: bool = True
    shuffle: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        # Checked here, where the settings are defined, so the CLI, the Dagster resource, a
        # sharding.yaml and a state file read back all get the same named error before any work
        # starts. The ranges are what the build can use: a bound that would overflow a count,
        # a tar size or a 64-bit seed later is refused now (and the value shown is cut short).
        def refuse(name: str, want: str) -> None:
            raise ShardingConfigError(
                f"sharding setting {name}={short_repr(getattr(self, name))} is invalid: it must be {want}"
            )

        def is_int(v: object, low: int, high: int) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool) and low <= v <= high

        m = self.max_shard_size_mb
        if (isinstance(m, bool) or not isinstance(m, numbers.Real) or not math.isfinite(m)
                or not MIN_SHARD_SIZE_MB <= m <= MAX_SHARD_SIZE_MB):
            refuse("max_shard_size_mb", f"a finite number of MiB > 0, from {MIN_SHARD_SIZE_MB} "
                                        f"(1 KiB) to {MAX_SHARD_SIZE_MB} (1 TiB)")
        if not is_int(self.shard_size, 0, MAX_COUNT):
            refuse("shard_size", f"a whole number from 0 to {MAX_COUNT} (0: bound shards by max_shard_size_mb)")
        if not is_int(self.part_size, 1, MAX_COUNT):
            refuse("part_size", f"a whole number >= 1, at most {MAX_COUNT}")
        if not is_int(self.seed, -(2**63), 2**63 - 1):
            refuse("seed", "a whole number that fits in 64 bits")
        for flag in ("classify_aspect_ratio", "shuffle"):
            if not isinstance(getattr(self, flag), bool):
                refuse(flag, "true or false")

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_size_mb * 1024 * 1024)

    def version(self) -> str:
        """Short digest of everything that changes which bytes land in which tar."""
        doc = json.dumps(
            {"plan": PLAN_VERSION, "max": self.max_shard_bytes, "n": self.shard_size, "part": self.part_size,
             "ar": self.classify_aspect_ratio, "shuffle": self.shuffle, "seed": self.seed if self.shuffle else None},
            sort_keys=True,
        )
        return hashlib.sha256(doc.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ShardPlan:
    bucket: str  # FLAT in flat mode
    index: int
    relpath: str  # part_<NNNNNN>/<NNNNNN>.tar
    samples: tuple[Sample, ...]
    modalities: tuple[str, ...]

    def members(self, modality: str) -> list[tuple[str, Sample]]:
        return [(member_name(s.key, sanitize_ext(_ext(s.files[modality].name))), s) for s in self.samples]

    def tar_bytes(self, modality: str) -> int:
        return tar_size([s.files[modality].size for s in self.samples])

    @property
    def total_bytes(self) -> int:
        return sum(self.tar_bytes(m) for m in self.modalities)

    def digest(self) -> str:
        """Identity of the bytes this shard will hold: its plan and its sources' fingerprints."""
        h = hashlib.sha256(f"{PLAN_VERSION}|{self.bucket}|{self.relpath}|{','.join(self.modalities)}".encode())
        for s in self.samples:
            h.update(s.key.encode())
            for m in self.modalities:
                f = s.files[m]
                h.update(f"|{m}|{f.name}|{f.size}|{f.fingerprint}".encode())
        return h.hexdigest()


def _ext(name: str) -> str:
    return name.rsplit(".", 1)[1] if "." in name else ""


def _sample_span(s: Sample, modalities: tuple[str, ...]) -> int:
    return sum(member_span(s.files[m].size) for m in modalities)


def _group_by_bytes(samples: list[Sample], modalities: tuple[str, ...], bound: int) -> list[list[Sample]]:
    # Fixed per-tar cost: end-of-archive blocks plus at most one record of padding per modality.
    fixed = len(modalities) * (END_OF_ARCHIVE + RECORD)
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    used = 0
    for s in samples:
        span = _sample_span(s, modalities)
        if current and used + span + fixed > bound:
            groups.append(current)
            current, used = [], 0
        current.append(s)
        used += span
    if current:
        groups.append(current)
    return groups


def plan_shards(samples: list[Sample], modalities: list[str], config: ShardingConfig) -> list[ShardPlan]:
    """Shards of every bucket, buckets in name order, shard indices from 0 within each bucket."""
    mods = tuple(sorted(modalities))
    buckets: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        buckets[(s.bucket or FLAT) if config.classify_aspect_ratio else FLAT].append(s)
    plans: list[ShardPlan] = []
    for bucket in sorted(buckets):
        items = sorted(buckets[bucket], key=lambda s: s.key)
        if config.shuffle:
            # Seeded from (seed, bucket) alone: the same config gives the same shards anywhere.
            random.Random(f"{config.seed}:{bucket}").shuffle(items)
        if config.shard_size > 0:
            groups = [items[i : i + config.shard_size] for i in range(0, len(items), config.shard_size)]
        else:
            groups = _group_by_bytes(items, mods, config.max_shard_bytes)
        for i, g in enumerate(groups):
            plans.append(ShardPlan(bucket, i, shard_relpath(i, config.part_size), tuple(g), mods))
    return plans


def is_oversize_singleton(plan: ShardPlan, config: ShardingConfig) -> bool:
    return len(plan.samples) == 1 and plan.total_bytes > config.max_shard_bytes
