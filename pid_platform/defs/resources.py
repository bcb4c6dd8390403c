"""The resources every asset uses: where sources live and builds go (``source_store``), how
sources are cut by default (``sharding``), and how S3 is reached (``s3``).

``source_store`` is one key with a local and an S3 implementation behind it, chosen from the raw
root: ``PID_RAW_ROOT`` (default ``demo/raw``) and ``PID_OUTPUT_ROOT`` (default ``demo/out``),
relative paths taken from the current directory. Either may be ``s3://bucket/prefix``: an S3
output is built in a local work folder (``PID_WORK_ROOT``) and published at the commit as a new
version behind a pointer (``pid_platform/sharding/commit/s3_output.py``).

``s3`` is dagster-aws's ``S3Resource``: endpoint (``AWS_ENDPOINT_URL``), region and profile as
configuration; credentials only from boto3's usual chain, never in configuration or metadata. The
build stays Dagster-free: it receives these settings (``S3Settings``), not a client, and makes
its clients with the project's one factory (``loader.io.s3_client``).
"""

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import dagster as dg
from dagster_aws.s3 import S3Resource
from pydantic import Field, field_validator

from loader.io import urls
from loader.io.s3_client import S3Settings
from pid_platform.sharding.commit.s3_output import (
    S3Output,
    default_work_root,
    is_s3_url,
    refuse_other_urls,
    work_dir,
)
from pid_platform.sharding.plan.shard_plan import PLAN_VERSION, ShardingConfig
from pid_platform.sharding.settings import SETTING_KEYS
from pid_platform.sharding.storage import LocalSourceStore, S3SourceStore, SourceStore

DEFAULT_RAW_ROOT = "demo/raw"
DEFAULT_OUTPUT_ROOT = "demo/out"
_DEFAULTS = ShardingConfig()  # the code defaults of the sharding settings: defined there, nowhere else
_UNSET = "Unset: the source's sharding.yaml, else"


def s3_settings(s3: S3Resource) -> S3Settings:
    """What the build needs to reach S3, from the ``s3`` resource; credentials are refused here
    (they would be shown in the UI's resource config and copied into every run's config)."""
    if s3.aws_access_key_id or s3.aws_secret_access_key or s3.aws_session_token:
        raise ValueError(
            "the s3 resource must not carry credentials; unset aws_access_key_id / aws_secret_access_key / "
            "aws_session_token and use boto3's chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
            "or an instance role)"
        )
    return S3Settings(endpoint_url=s3.endpoint_url or None, region=s3.region_name or None,
                      profile=s3.profile_name or None, max_attempts=s3.max_attempts)


class SourceStoreResource(dg.ConfigurableResource, ABC):
    """Reads raw sources from ``raw_root``; each source's build goes to ``output_root/<source>``."""

    raw_root: str = Field(description="Folder (or s3://bucket/prefix) holding one folder per source.")
    output_root: str = Field(description="Folder (or s3://bucket/prefix) the twin tars, manifests and catalog go to.")
    work_root: str = Field(default="", description="For an s3:// output_root: the local folder builds stage in "
                           "(default: $PID_WORK_ROOT or ~/.cache/pid-platform/work).")
    s3: dg.ResourceDependency[S3Resource]

    @abstractmethod
    def open(self) -> SourceStore: ...

    def s3_settings(self) -> S3Settings:
        return s3_settings(self.s3)

    def _checked(self, source: str) -> str:
        # A partition key becomes a folder name: a hand-added key must not point outside the root.
        if not source or source in (".", "..") or "/" in source or "\\" in source or source.startswith("."):
            raise ValueError(
                f"source {source!r} is not a plain folder name; delete that partition of 'sources' "
                "in the UI and add the source's folder name instead"
            )
        return source

    def root_target(self) -> S3Output | None:
        """The S3 output root, or ``None`` for a local one."""
        return S3Output(self.output_root, self.s3_settings()) if is_s3_url(self.output_root) else None

    def source_target(self, source: str) -> S3Output | None:
        """Where a source's build is published on S3 (``None``: the local ``source_out`` is the output)."""
        root = self.root_target()
        return root.child(self._checked(source)) if root else None

    def source_out(self, source: str) -> Path:
        """The local folder a source's build stages and commits in: its output, or for an S3
        output the work folder it is published from."""
        target = self.source_target(source)
        if target is not None:
            return work_dir(target, self.work_root or default_work_root())
        return Path(self.output_root) / self._checked(source)

    def source_output(self, source: str) -> S3Output | Path:
        """The output a build of ``source`` switches: its S3 prefix, or its folder."""
        return self.source_target(source) or self.source_out(source)

    def output_location(self, source: str) -> str:
        """Where readers find a source's build (a folder, or the S3 prefix with its pointer)."""
        target = self.source_target(source)
        return str(target) if target else str(self.source_out(source))


class LocalSourceStoreResource(SourceStoreResource):
    """Sources in a local (or mounted) folder."""

    def open(self) -> SourceStore:
        return LocalSourceStore(self.raw_root)


class S3SourceStoreResource(SourceStoreResource):
    """Sources under an ``s3://`` prefix of any S3-compatible store (reached through ``s3``)."""

    def open(self) -> SourceStore:
        return S3SourceStore(self.raw_root, settings=self.s3_settings())


class ShardingResource(dg.ConfigurableResource):
    """How sources are cut into twin tars by default, and which logical datasets group them.

    The first seven fields change which bytes land in which tar. They are unset (``None``) unless
    someone sets them: a source's own ``sharding.yaml`` (in its raw folder) decides, and the code
    defaults (``ShardingConfig()``) fill what neither sets. So the launchpad, which pre-fills
    every default it finds, cannot restate a setting the operator did not touch. Set in the
    launchpad for a run, a setting is written into that file, so the sensor and the daily
    schedule keep it (``pid_platform/defs/settings.py``); set where the resource is bound, it
    is the code location's default for sources whose file does not set it.
    """

    max_shard_size_mb: float | None = Field(
        default=None, description=f"Bound on a shard's tars, all modalities together, in MiB. {_UNSET} "
        f"{_DEFAULTS.max_shard_size_mb:g}.")
    shard_size: int | None = Field(
        default=None, description=f"If > 0: this many samples per shard instead of the byte bound. {_UNSET} "
        f"{_DEFAULTS.shard_size}.")
    part_size: int | None = Field(default=None, description=f"Tars per part_<NNNNNN> folder. {_UNSET} "
                                  f"{_DEFAULTS.part_size}.")
    classify_aspect_ratio: bool | None = Field(
        default=None, description=f"Put images in aspect_ratio_<W>_<H> buckets. {_UNSET} "
        f"{str(_DEFAULTS.classify_aspect_ratio).lower()}.")
    shuffle: bool | None = Field(default=None, description=f"Shuffle samples within a bucket. {_UNSET} "
                                 f"{str(_DEFAULTS.shuffle).lower()}.")
    seed: int | None = Field(default=None, description=f"Seed of the shuffle. {_UNSET} {_DEFAULTS.seed}.")
    new_modality_missing_keys: str | None = Field(
        default=None, description="When a modality folder is added to a built source: 'reshard' drops the keys it "
        "lacks with a full re-shard, 'keep' keeps the committed plan and those keys (index mode skips their missing "
        f"member). Either way, one that covers every key writes only its own tars. {_UNSET} "
        f"{_DEFAULTS.new_modality_missing_keys}.")
    num_workers: int = Field(
        default=2,
        description="Parallel workers per build step (processes for intake and key indexes, threads for "
        "tar writing and hashing).",
    )
    write_tasks: int = Field(
        default=0,
        description="Write tasks a source's tars are cut into (Dagster steps placed by the run's executor, each "
        "a contiguous range of shards). 0: enough tasks that none holds more than shards_per_write_task shards "
        "(one task for a small source). The bytes do not depend on it.",
    )
    shards_per_write_task: int = Field(
        default=64, description="With write_tasks 0: the most shards one write task holds.")
    trust_pickle: bool = Field(default=False,
                               description="Allow embeddings that need pickle to load (trusted data only).")
    datasets: dict[str, Any] = Field(
        default_factory=dict,
        description="Logical dataset name -> its sources, for the catalog: a list of source names (a union), or a "
        "weighted mixture {'sources': {'photos': {'weight': 0.6}, 'web': {'weight': 0.4}}, 'samples_per_epoch': N} "
        "(per source one of weight, repeat or choose; optional 'modalities', 'aspect_ratios'). Checked against the "
        "built sources when dataset_catalog writes catalog.json (loader.formats.catalog.check_datasets).",
    )
    manifest_root: str = Field(
        default="relative",
        description="Root written into each wdinfo.json: 'relative' (the manifest's folder; moved data keeps "
        "working), 'absolute' (the source output folder's absolute path, which PiD's reader needs) or the URL "
        "the output root is published at (s3://bucket/prefix; a source's roots go below <URL>/<source>).",
    )

    @field_validator("write_tasks")
    @classmethod
    def _tasks_not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"write_tasks={value}: give a number of tasks >= 1, or 0 to derive it from "
                             "shards_per_write_task")
        return value

    @field_validator("shards_per_write_task")
    @classmethod
    def _positive_task_size(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"shards_per_write_task={value}: a write task holds at least one shard; give 1 or more")
        return value

    def write_tasks_for(self, shards: int) -> int:
        """How many write tasks cut a plan of ``shards`` shards: ``write_tasks``, else one per
        ``shards_per_write_task`` shards; never more tasks than shards, and at least one."""
        wanted = self.write_tasks or -(-shards // self.shards_per_write_task)
        return max(1, min(wanted, shards))

    def manifest_root_of(self, source: str) -> str:
        """The manifest-root mode of one source's build: a URL names the output root, so a source's
        output folder is ``<URL>/<source>``."""
        if urls.has_scheme(self.manifest_root):
            return f"{self.manifest_root.rstrip('/')}/{source}"
        return self.manifest_root

    def settings_set(self) -> dict[str, Any]:
        """The sharding settings given a value here (in the launchpad, or where it is bound)."""
        return {k: v for k in SETTING_KEYS if (v := getattr(self, k)) is not None}

    def config(self, without: Iterable[str] = ()) -> ShardingConfig:
        """The code defaults overridden by the settings set here (except those in ``without``).
        ``ShardingConfig`` validates them (the one place that does), naming the setting; every
        run step and tick calls this before any work."""
        skip = set(without)
        return ShardingConfig(**{**asdict(_DEFAULTS),
                                 **{k: v for k, v in self.settings_set().items() if k not in skip}})


DEFAULT_SHARDING = ShardingResource()

# Part of the code version of every asset whose bytes depend on the sharding parameters: changing
# the plan format or the default config marks those assets stale in the UI.
SHARDING_CODE_VERSION = f"plan-v{PLAN_VERSION}-{_DEFAULTS.version()}"


def s3_from_env(environ: Mapping[str, str] | None = None) -> S3Resource:
    """The ``s3`` resource: endpoint and region from the environment, no credentials."""
    env = os.environ if environ is None else environ
    return S3Resource(
        endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
        region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
    )


def source_store_from_env(environ: Mapping[str, str] | None = None, s3: S3Resource | None = None) -> SourceStoreResource:
    """The store the code location binds: local unless ``PID_RAW_ROOT`` is an ``s3://`` URI; the
    output is local unless ``PID_OUTPUT_ROOT`` is one."""
    env = os.environ if environ is None else environ
    s3 = s3 or s3_from_env(env)
    raw = env.get("PID_RAW_ROOT") or DEFAULT_RAW_ROOT
    out = env.get("PID_OUTPUT_ROOT") or DEFAULT_OUTPUT_ROOT
    refuse_other_urls(out, "PID_OUTPUT_ROOT")
    refuse_other_urls(raw, "PID_RAW_ROOT")
    if is_s3_url(out):
        S3Output(out)  # a malformed s3:// URL fails the code location's load, with the variable named
    else:
        # Absolute now, so a run worker started from another folder writes to the same place.
        out = str(Path(urls.local_path(out)).resolve())
    work = str(Path(env.get("PID_WORK_ROOT") or default_work_root()).resolve())
    if urls.is_s3(raw):
        return S3SourceStoreResource(raw_root=raw, output_root=out, work_root=work, s3=s3)
    return LocalSourceStoreResource(raw_root=str(Path(urls.local_path(raw)).resolve()), output_root=out,
                                    work_root=work, s3=s3)


@dg.definitions
def resources() -> dg.Definitions:
    s3 = s3_from_env()
    return dg.Definitions(resources={
        "s3": s3, "source_store": source_store_from_env(s3=s3), "sharding": DEFAULT_SHARDING,
    })
