"""The streaming reader's options: LeRobot's names and defaults, validated where they are defined.

Every option is per rank unless its comment says otherwise; a rank with N DataLoader workers
gives each worker 1/N of the episode pool, the byte budget and the decoder cache
(``per_worker``). Unknown names, non-positive numbers and unknown strategies are refused here,
so every entry point (the dataset, a trainer's config, the Dagster check) gets the same message.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from loader.formats.errors import short_repr

SAMPLING_STRATEGIES = ("remaining", "round_robin")
FRAME_DTYPES = ("float32", "uint8")
DEFAULT_SEED = 42   # what seed=None means (LeRobot's fixed streaming seed)
_GB = 1 << 30
MAX_DELTA_S = 1e6  # about 11 days: past any episode, so past any frame a delta could land on


def worker_share(total: int, num_workers: int) -> int:
    """One worker's part of a per-rank amount (``num_workers`` 0: the training process reads)."""
    return max(1, total // max(1, num_workers))


@dataclass(frozen=True)
class StreamingOptions:
    streaming_episode_pool_size: int = 32        # complete episodes mixed per rank (pool/N per worker)
    streaming_sampling_strategy: str = "remaining"
    streaming_prefetch_episodes: int = 8         # episodes fetched ahead per worker
    streaming_byte_budget_gb: float = 8.0        # MP4 payload bytes held per rank
    streaming_decode_threads: int | None = None  # decode threads per worker; None: the cores this
    #                                              process may run on, divided among the workers
    streaming_decoded_queue_size: int = 8        # decoded samples kept ahead, in planner order
    video_decoder_cache_size: int | None = None  # open decoders per rank; None: pool x cameras
    streaming_native_http_connections: int | None = None   # HTTP requests in flight per rank; None: no cap
    streaming_native_http_subranges: int = 1     # parallel sub-ranges per HTTP range read
    streaming_sidecar_lock_timeout_s: float = 1800.0
    max_num_shards: int = 16                     # episodes fetched in parallel per worker
    # Camera frames as LeRobot gives them (float32 in [0, 1]) or as decoded (uint8, exactly the
    # float32 values x 255): a quarter of the bytes through DataLoader workers' shared memory;
    # convert where it is cheap (``frames.float().div_(255)`` on the GPU gives the float32 frames).
    frame_dtype: str = "float32"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("video_decoder_cache_size", "streaming_native_http_connections",
                                            "streaming_decode_threads"):
                continue
            if f.name == "frame_dtype":
                if value not in FRAME_DTYPES:
                    raise ValueError(f"frame_dtype must be one of {list(FRAME_DTYPES)}, got {value!r}")
                continue
            if f.name == "streaming_sampling_strategy":
                if value not in SAMPLING_STRATEGIES:
                    raise ValueError(f"streaming_sampling_strategy must be one of {list(SAMPLING_STRATEGIES)}, "
                                     f"got {value!r}")
                continue
            floats = f.name in ("streaming_byte_budget_gb", "streaming_sidecar_lock_timeout_s")
            ok_type = (isinstance(value, int | float) if floats else isinstance(value, int)) and not isinstance(value, bool)
            if not ok_type:
                want = "a number" if floats else "an integer"
                raise ValueError(f"{f.name} must be {want}, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{f.name} must be positive and finite, got {value!r}")

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> StreamingOptions:
        """Build from ``**streaming_options``; an unknown name is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown streaming option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
                             f"known options: {', '.join(sorted(known))}")
        return cls(**options)

    # ``episodes`` and ``delta_timestamps`` come from a trainer's config file as often as from code:
    # checked here, before any metadata is read, so a hostile or mistyped value is one ValueError
    # that names the option, never a silent int(1.5) == 1, True == episode 1, or a NaN frame offset.
    @staticmethod
    def validate_episodes(episodes: Any) -> list[int] | None:
        """``episodes=``: None (all) or a sequence of episode indices, whole numbers >= 0."""
        if episodes is None:
            return None
        if isinstance(episodes, str | bytes | Mapping) or not isinstance(episodes, Iterable):
            raise ValueError(f"episodes must be a list of episode indices (whole numbers >= 0), got {short_repr(episodes)}")
        out = []
        for i, e in enumerate(episodes):
            if isinstance(e, bool | np.bool_) or not isinstance(e, numbers.Integral) or e < 0:
                raise ValueError(f"episodes[{i}] is {short_repr(e)}: episodes must list episode indices, "
                                 "whole numbers >= 0 (not 1.5, True or '0')")
            out.append(int(e))
        return out

    @staticmethod
    def validate_delta_timestamps(delta_timestamps: Any) -> dict[str, list[float]] | None:
        """``delta_timestamps=``: None or {feature: [seconds, ...]}, each delta a finite number."""
        if delta_timestamps is None:
            return None
        if not isinstance(delta_timestamps, Mapping):
            raise ValueError(f"delta_timestamps must map feature names to lists of seconds, got {short_repr(delta_timestamps)}")
        out: dict[str, list[float]] = {}
        for key, deltas in delta_timestamps.items():
            if not isinstance(key, str):
                raise ValueError(f"delta_timestamps keys must be feature names, got {short_repr(key)}")
            if isinstance(deltas, str | bytes | Mapping) or not isinstance(deltas, Iterable):
                raise ValueError(f"delta_timestamps[{key!r}] must be a list of seconds, got {short_repr(deltas)}")
            values = []
            for i, d in enumerate(deltas):
                ok = isinstance(d, numbers.Real) and not isinstance(d, bool | np.bool_)
                if not ok or not math.isfinite(d) or abs(d) > MAX_DELTA_S:
                    raise ValueError(f"delta_timestamps[{key!r}][{i}] is {short_repr(d)}: each delta must be a finite "
                                     f"number of seconds within +-{MAX_DELTA_S:g}")
                values.append(float(d))
            out[key] = values
        return out

    def decode_threads(self, num_workers: int) -> int:
        """Decode threads of one of ``num_workers`` workers: the option, else the cores this
        process may run on (``os.sched_getaffinity``) divided among the workers, at least 1, so
        the workers' decoders do not contend for the same cores."""
        if self.streaming_decode_threads is not None:
            return self.streaming_decode_threads
        return max(1, available_cores() // max(1, num_workers))

    @property
    def byte_budget(self) -> int:
        """The per-rank byte budget in bytes (GiB, as LeRobot counts it)."""
        return int(self.streaming_byte_budget_gb * _GB)

    def per_worker(self, num_workers: int, cameras: int) -> WorkerShare:
        """What one of ``num_workers`` DataLoader workers (0 means the training process) gets."""
        decoders = self.video_decoder_cache_size or self.streaming_episode_pool_size * max(1, cameras)
        conns = self.streaming_native_http_connections
        return WorkerShare(
            pool_size=worker_share(self.streaming_episode_pool_size, num_workers),
            byte_budget=worker_share(self.byte_budget, num_workers),
            decoder_cache=worker_share(decoders, num_workers),
            http_connections=None if conns is None else worker_share(conns, num_workers),
        )


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class WorkerShare:
    pool_size: int
    byte_budget: int
    decoder_cache: int
    http_connections: int | None
