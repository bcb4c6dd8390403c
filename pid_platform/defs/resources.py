"""The two resources every asset uses: where sources live (``source_store``) and how they are
cut (``sharding``).

``source_store`` is one key with a local and an S3 implementation behind it, chosen from the raw
root: ``PID_RAW_ROOT`` (default ``demo/raw``) and ``PID_OUTPUT_ROOT`` (default ``demo/out``),
relative paths taken from the current directory; an ``s3://`` raw root reads through S3 with the
endpoint from ``AWS_ENDPOINT_URL`` (credentials stay in boto3's own chain, never in config).
"""

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import dagster as dg
from pydantic import Field

from pid_platform.build.plan import PLAN_VERSION, ShardingConfig
from pid_platform.build.storage import LocalSourceStore, S3SourceStore, SourceStore

DEFAULT_RAW_ROOT = "demo/raw"
DEFAULT_OUTPUT_ROOT = "demo/out"
_DEFAULTS = ShardingConfig()


class SourceStoreResource(dg.ConfigurableResource, ABC):
    """Reads raw sources from ``raw_root``; each source's build goes to ``output_root/<source>``."""

    raw_root: str = Field(description="Folder (or s3://bucket/prefix) holding one folder per source.")
    output_root: str = Field(description="Local folder the twin tars, manifests and catalog go to.")

    @abstractmethod
    def open(self) -> SourceStore: ...

    def source_out(self, source: str) -> Path:
        # A partition key becomes a folder name: a hand-added key must not point outside the root.
        if not source or source in (".", "..") or "/" in source or "\\" in source or source.startswith("."):
            raise ValueError(
                f"source {source!r} is not a plain folder name; delete that partition of 'sources' "
                "in the UI and add the source's folder name instead"
            )
        return Path(self.output_root) / source


class LocalSourceStoreResource(SourceStoreResource):
    """Sources in a local (or mounted) folder."""

    def open(self) -> SourceStore:
        return LocalSourceStore(self.raw_root)


class S3SourceStoreResource(SourceStoreResource):
    """Sources under an ``s3://`` prefix of any S3-compatible store."""

    endpoint_url: str | None = Field(default=None, description="S3 endpoint; AWS's when empty.")

    def open(self) -> SourceStore:
        return S3SourceStore(self.raw_root, self.endpoint_url)


class ShardingResource(dg.ConfigurableResource):
    """How sources are cut into twin tars, and which logical datasets group them.

    Changing any of the first six fields changes which bytes land in which tar (its
    ``version()``), so the next build of a source re-shards it.
    """

    max_shard_size_mb: float = Field(default=_DEFAULTS.max_shard_size_mb,
                                     description="Bound on a shard's tars, all modalities together.")
    shard_size: int = Field(default=_DEFAULTS.shard_size,
                            description="If > 0: this many samples per shard instead of the byte bound.")
    part_size: int = Field(default=_DEFAULTS.part_size, description="Tars per part_<NNNNNN> folder.")
    classify_aspect_ratio: bool = Field(default=_DEFAULTS.classify_aspect_ratio,
                                        description="Put images in aspect_ratio_<W>_<H> buckets.")
    shuffle: bool = Field(default=_DEFAULTS.shuffle, description="Shuffle samples within a bucket.")
    seed: int = Field(default=_DEFAULTS.seed, description="Seed of the shuffle.")
    num_workers: int = Field(
        default=2,
        description="Parallel workers per build step (processes for intake and key indexes, threads for "
        "tar writing and hashing).",
    )
    trust_pickle: bool = Field(default=False,
                               description="Allow embeddings that need pickle to load (trusted data only).")
    datasets: dict[str, list[str]] = Field(default_factory=dict,
                                           description="Logical dataset name -> its sources, for the catalog.")
    manifest_root: str = Field(
        default="relative",
        description="Root written into each wdinfo.json: 'relative' (the manifest's folder; moved data keeps "
        "working), 'absolute' (the source output folder's absolute path, which PiD's reader needs) or the URL "
        "the output root is published at (s3://bucket/prefix; a source's roots go below <URL>/<source>).",
    )

    def manifest_root_of(self, source: str) -> str:
        """The manifest-root mode of one source's build: a URL names the output root, so a source's
        output folder is ``<URL>/<source>``."""
        if "://" in self.manifest_root:
            return f"{self.manifest_root.rstrip('/')}/{source}"
        return self.manifest_root

    def config(self) -> ShardingConfig:
        return ShardingConfig(
            max_shard_size_mb=self.max_shard_size_mb, shard_size=self.shard_size, part_size=self.part_size,
            classify_aspect_ratio=self.classify_aspect_ratio, shuffle=self.shuffle, seed=self.seed,
        )


DEFAULT_SHARDING = ShardingResource()

# Part of the code version of every asset whose bytes depend on the sharding parameters: changing
# the plan format or the default config marks those assets stale in the UI.
SHARDING_CODE_VERSION = f"plan-v{PLAN_VERSION}-{DEFAULT_SHARDING.config().version()}"


def source_store_from_env(environ: Mapping[str, str] | None = None) -> SourceStoreResource:
    """The store the code location binds: local unless ``PID_RAW_ROOT`` is an ``s3://`` URI."""
    env = os.environ if environ is None else environ
    raw = env.get("PID_RAW_ROOT") or DEFAULT_RAW_ROOT
    out = env.get("PID_OUTPUT_ROOT") or DEFAULT_OUTPUT_ROOT
    if "://" in out and not out.startswith("file://"):
        raise ValueError(f"PID_OUTPUT_ROOT={out!r}: builds are written to a local folder; give a path")
    # Absolute now, so a run worker started from another folder writes to the same place.
    out = str(Path(out.removeprefix("file://")).resolve())
    if raw.startswith("s3://"):
        return S3SourceStoreResource(raw_root=raw, output_root=out, endpoint_url=env.get("AWS_ENDPOINT_URL"))
    return LocalSourceStoreResource(raw_root=str(Path(raw.removeprefix("file://")).resolve()), output_root=out)


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(resources={"source_store": source_store_from_env(), "sharding": DEFAULT_SHARDING})
