"""Read a mixture's sources: each one's manifests, its modalities checked, one shard table.

Rank 0 reads (``load_mixture``), every rank receives the result, as for one source. The
sources' shard tables are laid end to end; ``MixtureSources.parts`` says where each source's
shards are, so a sample's ``__sid__`` stays unique across the mixture.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from loader.formats.errors import FormatError
from loader.mixture.definition import Mixture, MixtureError, check_modalities
from loader.wds.errors import ManifestError
from loader.wds.shard_table import ShardTable, Wdinfo


@dataclass(frozen=True)
class MixtureSources:
    mixture: Mixture
    table: ShardTable  # every source's shards, source after source
    offsets: tuple[int, ...]  # each source's first shard in ``table``
    shard_counts: tuple[int, ...]  # each source's number of shards
    sizes: tuple[int, ...]  # each source's samples (after the aspect-ratio filter)
    modalities: tuple[str, ...]
    fingerprints: tuple[str, ...]  # each source's own shard-list fingerprint
    chunk_size: int


def _only(table: ShardTable, modalities: tuple[str, ...]) -> ShardTable:
    """The table read with these modalities only (each of its manifests has them all)."""
    table.keys = [modalities for _ in table.keys]
    table.__dict__.pop("_fingerprint", None)
    return table


def concat_tables(tables: Sequence[ShardTable]) -> ShardTable:
    """Shard tables end to end (lookup lists merged, ids remapped)."""
    def merged(name: str, ids_name: str) -> tuple[list, np.ndarray]:
        values: dict = {}
        ids = []
        for t in tables:
            remap = np.asarray([values.setdefault(v, len(values)) for v in getattr(t, name)], np.int32)
            ids.append(remap[getattr(t, ids_name)] if len(remap) else getattr(t, ids_name))
        return list(values), np.concatenate(ids)

    roots, root_ids = merged("roots", "root_ids")
    keys, keys_ids = merged("keys", "keys_ids")
    sources, source_ids = merged("sources", "source_ids")
    buckets, bucket_ids = merged("buckets", "bucket_ids")
    with_dirs = all(t.dirs is not None for t in tables)
    dirs, dir_ids = merged("dirs", "dir_ids") if with_dirs else (None, None)
    sha256 = None
    if all(t.sha256 is not None for t in tables):
        mods = sorted({m for t in tables for m in t.sha256 or {}})
        sha256 = {m: pa.concat_arrays([(t.sha256 or {}).get(m, pa.nulls(len(t), pa.string())) for t in tables])
                  for m in mods}
    pid = None
    if any(t.pid_names is not None for t in tables):
        pid = np.concatenate([t.pid_names if t.pid_names is not None else np.zeros(len(t), bool) for t in tables])
    sizes = None
    if any(t.sizes is not None for t in tables):
        mods = sorted({m for t in tables for m in t.sizes or {}})
        sizes = {m: np.concatenate([(t.sizes or {}).get(m, np.full(len(t), -1, np.int64)) for t in tables])
                 for m in mods}
    return ShardTable(
        roots, root_ids, pa.concat_arrays([t.paths for t in tables]), np.concatenate([t.counts for t in tables]),
        pa.concat_arrays([t.key_indexes for t in tables]), keys, keys_ids, sources, source_ids, buckets,
        bucket_ids, dirs, dir_ids, sha256=sha256,
        checksums_digest="|".join(t.checksums_digest for t in tables) if any(t.checksums_digest for t in tables) else "",
        pid_names=pid, sizes=sizes,
    )


def _read_source(mix: Mixture, index: int, catalog: str | None, aspect_ratios: Iterable[str] | None,
                 keep_sha256: bool) -> Wdinfo:
    from loader.wds.discovery import find_source_manifests, parse_manifests

    source = mix.sources[index]
    spec = source.spec
    if isinstance(spec, Wdinfo):
        return spec
    try:
        return parse_manifests(find_source_manifests(spec, catalog), aspect_ratios=aspect_ratios, keep_sha256=keep_sha256)
    except (ManifestError, FormatError) as exc:
        raise mix.error(f"cannot be read ({exc})", "build the source, or fix its name or path", source) from None


def load_mixture(mix: Mixture, *, catalog: str | None = None, modalities: Sequence[str] | None = None,
                 aspect_ratios: Iterable[str] | None = None, keep_sha256: bool = False,
                 broadcast: bool = True) -> MixtureSources:
    """Every source of ``mix`` read and checked (rank 0 reads; the others receive)."""
    from loader.wds.distributed import run_on_rank0_and_broadcast

    def work() -> MixtureSources:
        ratios = aspect_ratios if aspect_ratios is not None else mix.aspect_ratios
        infos = [_read_source(mix, i, catalog, ratios, keep_sha256) for i in range(len(mix.sources))]
        # A source is read with the modalities every one of its manifests has.
        have = {s.label: sorted(set.intersection(*(set(k) for k in info.tar_files.keys)))
                for s, info in zip(mix.sources, infos, strict=True)}
        wanted = check_modalities(mix, have, modalities)
        tables = [_only(info.tar_files, wanted) for info in infos]
        offsets = tuple(np.cumsum([0] + [len(t) for t in tables[:-1]]).tolist())
        return MixtureSources(
            mix, concat_tables(tables), offsets, tuple(len(t) for t in tables),
            tuple(t.total_samples for t in tables), wanted, tuple(t.fingerprint() for t in tables),
            max(info.chunk_size for info in infos),
        )

    try:
        return run_on_rank0_and_broadcast(work) if broadcast else work()
    except MixtureError:
        raise
    except ValueError as exc:  # a reader's malformed-file error, with the dataset named
        raise MixtureError(f"dataset {mix.name!r}: {exc}") from None
