"""Stream tuning (``StreamConfig``) and the counters every stream reports into (``StreamStats``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class StreamConfig:
    """How remote byte streams connect, wait, retry and authenticate.

    Frozen so one config can be shared by every stream of a loader (and pickled to workers).
    """

    max_retries: int = 8              # reopen attempts per stream before RetryBudgetExceeded
    backoff_base_s: float = 0.2       # jittered exponential back-off: base * 2**attempt * U(0.5, 1.5), capped
    backoff_max_s: float = 10.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0      # a read that stalls this long counts as a failure -> reopen
    min_throughput_bps: float = 0.0   # >0: if throughput over `throughput_window_s` stays below this, reconnect
    throughput_window_s: float = 5.0
    s3_endpoint_url: str | None = None   # else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS default
    hf_endpoint: str | None = None       # else HF_ENDPOINT env, else https://huggingface.co
    hf_token: str | None = field(default=None, repr=False)  # else huggingface_hub's lookup; never logged
    seed: int = 0                        # jitter RNG is seeded from (seed, url): no wall-clock randomness
    # Read-ahead of remote twin tars (loader/io/read_ahead.py): bounded ranged GETs in flight at
    # once per process (a DataLoader worker or the training process). 0 bytes: one open-ended
    # stream per tar, as before. See the README's "Reading from a bucket".
    read_ahead_bytes: int = 64 << 20     # asked for, fetched or being handed out, per process, at most
    # 32 GETs of at most 2 MiB fill the same budget as 16 of 4 MiB with twice the first-byte waits
    # overlapped: measured (bench_remote_read, 3,000 samples, 0 workers) +29% samples/s at 20 ms and
    # +19% at 60 ms; 8 MiB blocks were 26% slower, and 2 MiB on 16 connections 16% slower.
    read_ahead_connections: int = 32     # ranged GETs in flight at once, per process
    read_ahead_block: int = 2 << 20      # bytes per ranged GET, at most

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"StreamConfig.max_retries must be >= 0, got {self.max_retries}")
        for name in ("backoff_base_s", "backoff_max_s", "min_throughput_bps"):
            if getattr(self, name) < 0:
                raise ValueError(f"StreamConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.read_ahead_bytes < 0:
            raise ValueError(f"StreamConfig.read_ahead_bytes must be >= 0 (0: no read-ahead), got {self.read_ahead_bytes}")
        for name in ("read_ahead_connections", "read_ahead_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"StreamConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout_s", "read_timeout_s", "throughput_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StreamConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Counters:
    """Integer counters shared by any number of threads in one process; subclasses declare the
    counters as ``int`` fields. Pickles without its lock, so counts travel to and from
    DataLoader workers."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if not f.name.startswith("_"))

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def merge(self, other: Counters | dict[str, int]) -> Counters:
        """Add ``other``'s counters (e.g. a worker's ``as_dict()``) into this one; return self."""
        counts = other.as_dict() if isinstance(other, Counters) else other
        names = self.names()
        self.add(**{k: int(v) for k, v in counts.items() if k in names})
        return self

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in self.names()}

    def __getstate__(self) -> dict[str, int]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


@dataclass
class StreamStats(Counters):
    """Counters every stream of a loader reports into.

    ``opens``: requests made (the first open and every reopen attempt);
    ``retries``: reopens after a failed or short read (these spend the retry budget);
    ``reconnects``: reopens because throughput stayed below the floor (free: data was flowing);
    ``bytes_skipped``: bytes discarded because a server ignored the Range header;
    ``bytes_handed``: bytes read-ahead streams handed to their readers (``bytes_read`` over this
    is the re-read factor: bytes fetched per byte used); ``ahead_dropped``: bytes fetched ahead
    and thrown away unread (a stream closed before its reader got there);
    ``ahead_waits`` / ``ahead_wait_ms``: reads that found their bytes not yet arrived, and the
    time they waited (a reader waiting on storage, not on its CPU).
    """

    bytes_read: int = 0
    bytes_handed: int = 0
    ahead_dropped: int = 0
    ahead_waits: int = 0
    ahead_wait_ms: int = 0
    retries: int = 0
    reconnects: int = 0
    opens: int = 0
    bytes_skipped: int = 0
