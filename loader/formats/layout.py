"""The names of a build's output layout, in one place.

::

    <out>/
      .pid-build/                                   build state (stamps, tables); not output
      <bucket>/                                     aspect_ratio_<W>_<H>, absent in flat mode
        wdinfo.json                                 the manifest (the commit point)
        <modality>/part_<NNNNNN>/<NNNNNN>.tar       twin tars, ``part_size`` per part folder
        _key_index/part_<NNNNNN>/<NNNNNN>.parquet   one key index per shard
    .<out>.pid-lock                                 beside the output, while a build runs
    .<out>.pid-run-hold.json                        beside the output, while a Dagster run builds it

The build (``pid_platform/sharding``) writes these names and the loader's discovery looks for them;
both import them from here, so neither can drift from the other.
"""

from __future__ import annotations

import re

WDINFO_NAME = "wdinfo.json"
STATE_DIR = ".pid-build"  # stamps and intermediate tables; not part of the output contract
BUCKET_PREFIX = "aspect_ratio_"  # PiD's bucket folder names: aspect_ratio_16_9, ...
PART_PREFIX = "part_"
KEY_INDEX_DIR = "_key_index"
KEY_INDEX_SUFFIX = ".parquet"
TAR_SUFFIX = ".tar"
LOCK_SUFFIX = ".pid-lock"  # the build lock: .<output folder name>.pid-lock beside it
RUN_HOLD_SUFFIX = ".pid-run-hold.json"  # a Dagster run's hold (pid_platform/sharding/run_hold.py)
DEFAULT_PART_SIZE = 1000


def bucket_name(width: int, height: int) -> str:
    """``aspect_ratio_<W>_<H>``: the folder of the aspect bucket W:H."""
    return f"{BUCKET_PREFIX}{width}_{height}"


def is_bucket_folder(name: str) -> bool:
    """Whether a folder name is an aspect bucket (PiD's manifests name no bucket: the folder does)."""
    return name.startswith(BUCKET_PREFIX)


def shard_relpath(index: int, part_size: int = DEFAULT_PART_SIZE) -> str:
    """``part_<NNNNNN>/<NNNNNN>.tar``: the path of shard ``index`` under a modality folder."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"{PART_PREFIX}{index // part_size:06d}/{index:06d}{TAR_SUFFIX}"


def key_index_relpath(shard_path: str) -> str:
    """Where the parquet key index of a shard lives, relative to the bucket leaf."""
    return f"{KEY_INDEX_DIR}/{shard_path[: -len(TAR_SUFFIX)]}{KEY_INDEX_SUFFIX}"


def lock_name(output_name: str) -> str:
    """The build lock's file name beside an output folder named ``output_name``."""
    return f".{output_name}{LOCK_SUFFIX}"


def run_hold_name(output_name: str) -> str:
    """The file name of a Dagster run's hold beside an output folder named ``output_name``."""
    return f".{output_name}{RUN_HOLD_SUFFIX}"


# Paths (relative to the output folder) of the files a build writes: tars, key indexes and
# manifests. Anything else under an output folder - another source's output, a user's files - is
# never a build's to delete.
_BUCKET = rf"(?:{re.escape(BUCKET_PREFIX)}\d+_\d+/)?"
_SHARD = rf"{re.escape(PART_PREFIX)}\d{{6,}}/\d{{6,}}"  # shard_relpath: six digits, more past a million
BUILD_OUTPUT_PATH = re.compile(
    rf"^{_BUCKET}(?:[^/]+/{_SHARD}{re.escape(TAR_SUFFIX)}|{re.escape(KEY_INDEX_DIR)}/{_SHARD}"
    rf"{re.escape(KEY_INDEX_SUFFIX)}|{re.escape(WDINFO_NAME)})$"
)
