"""Shard planning: group each bucket's samples into size- or count-bounded shards.

The bound is on the exact bytes the shard's tars occupy, all modalities together (headers,
padding and end-of-archive included), so "every tar respects the bound" is checkable on disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa

from loader.formats.errors import short_repr
from loader.formats.twin_tar import (
    DEFAULT_PART_SIZE,
    member_name,
    sanitize_ext,
    shard_relpath,
    tar_size,
)
from pid_platform.sharding.errors import ShardingConfigError
from pid_platform.sharding.intake.file_checks import ext_of
from pid_platform.sharding.intake.task import Sample

FLAT = ""  # bucket name used in flat mode (no aspect-ratio folders)
MIN_SHARD_SIZE_MB = 1 / 1024  # 1 KiB: below a tar record every sample is a shard of its own anyway
MAX_SHARD_SIZE_MB = 1024 * 1024  # 1 TiB per shard
MAX_COUNT = 2**31 - 1  # samples per shard, tars per part folder: what a Dagster (GraphQL) Int holds
PLAN_VERSION = 1
# What a build does with the committed plan's keys that a newly added modality folder lacks
# (``plan/add_modality.py``): drop them with a full re-shard, or keep the committed plan and them
# (their new-modality member missing: index mode skips them, zip mode refuses those shards).
RESHARD, KEEP = "reshard", "keep"
MISSING_KEYS_CHOICES = (RESHARD, KEEP)


@dataclass(frozen=True)
class ShardingConfig:
    max_shard_size_mb: float = 500.0
    shard_size: int = 0  # > 0: fixed samples per shard instead of the byte bound
    part_size: int = DEFAULT_PART_SIZE
    classify_aspect_ratio: bool = True
    shuffle: bool = False
    seed: int = 0
    new_modality_missing_keys: str = RESHARD

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
        if self.new_modality_missing_keys not in MISSING_KEYS_CHOICES:
            refuse("new_modality_missing_keys",
                   f"{RESHARD!r} (a full re-shard drops the keys a new modality folder lacks) or {KEEP!r} "
                   "(the committed plan keeps them; index mode skips their missing member)")

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_size_mb * 1024 * 1024)

    def version(self) -> str:
        """Short digest of everything that changes which bytes land in which tar."""
        doc = json.dumps(
            {"plan": PLAN_VERSION, "max": self.max_shard_bytes, "n": self.shard_size, "part": self.part_size,
             "ar": self.classify_aspect_ratio, "shuffle": self.shuffle, "seed": self.seed if self.shuffle else None,
             # Only when set otherwise: every version made before the setting existed stays the same.
             **({"missing": self.new_modality_missing_keys} if self.new_modality_missing_keys != RESHARD else {})},
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
        """The tar's members in plan order; a sample without a file of ``modality`` (a key kept
        when that modality was added, ``new_modality_missing_keys: keep``) has none."""
        return [(member_name(s.key, sanitize_ext(ext_of(s.files[modality].name))), s) for s in self.samples
                if modality in s.files]

    def tar_bytes(self, modality: str) -> int:
        return tar_size([s.files[modality].size for s in self.samples if modality in s.files])

    def restricted(self, modalities: tuple[str, ...]) -> ShardPlan:
        """This shard as a plan of ``modalities`` only: what a build with those alone planned."""
        samples = tuple(replace(s, files={m: f for m, f in s.files.items() if m in modalities}) for s in self.samples)
        return ShardPlan(self.bucket, self.index, self.relpath, samples, tuple(sorted(modalities)))

    @property
    def count(self) -> int:
        return len(self.samples)

    @property
    def total_bytes(self) -> int:
        return sum(self.tar_bytes(m) for m in self.modalities)

    def digest(self) -> str:
        """Identity of the bytes this shard will hold: its plan and its sources' fingerprints."""
        h = hashlib.sha256(f"{PLAN_VERSION}|{self.bucket}|{self.relpath}|{','.join(self.modalities)}".encode())
        for s in self.samples:
            h.update(s.key.encode())
            for m in self.modalities:
                f = s.files.get(m)
                if f is None:  # a kept key without this modality's file
                    h.update(f"|{m}|-".encode())
                    continue
                h.update(f"|{m}|{f.name}|{f.size}|{f.fingerprint}".encode())
        return h.hexdigest()


def plan_shards(samples: list[Sample], modalities: list[str], config: ShardingConfig) -> list[ShardPlan]:
    """Shards of every bucket, buckets in name order, shard indices from 0 within each bucket.

    The objects' columns go through the columnar plan (``columnar.layout_shards``), which
    ``columnar.write_plan_file`` also runs over a samples table of any size.
    """
    from pid_platform.sharding.plan.columnar import plan_layout  # columnar imports this module

    mods = tuple(sorted(modalities))
    sizes = [np.fromiter((s.files[m].size for s in samples), dtype=np.int64, count=len(samples)) for m in mods]
    layout = plan_layout(pa.array([s.bucket for s in samples], pa.string()), sizes, config,
                         keys=pa.array([s.key for s in samples], pa.string()))
    order = layout.order.tolist()
    offsets = layout.offsets.tolist()
    plans: list[ShardPlan] = []
    for s, (b, i) in enumerate(zip(layout.shard_bucket.tolist(), layout.shard_index.tolist(), strict=True)):
        group = tuple(samples[r] for r in order[offsets[s] : offsets[s + 1]])
        plans.append(ShardPlan(layout.bucket_names[b], i, shard_relpath(i, config.part_size), group, mods))
    return plans


def is_oversize_singleton(plan: ShardPlan, config: ShardingConfig) -> bool:
    """A shard of one sample above the bound (which it may be: a sample is never split).
    ``plan``: a ``ShardPlan`` or a ``columnar.ShardRef`` (its count and total bytes)."""
    return plan.count == 1 and plan.total_bytes > config.max_shard_bytes
