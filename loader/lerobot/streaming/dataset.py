"""``StreamingLeRobotDataset``: LeRobot's map-style items, streamed from a v3 dataset's parquet
rows and MP4 byte spans, with exact coverage, a byte budget and exact resume.

See the package docstring and ``docs/formats.md`` (LeRobot streaming) for the design; the
modules each hold one part: ``options`` (settings), ``ownership`` (ranks and workers),
``planner`` (the episode pool), ``executor`` (fetch/decode threads), ``items`` (LeRobot's item
rules), ``state`` (resume), ``video`` (spans and decoding), ``tabular``/``ranges`` (fetching).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from loader.io import StreamConfig
from loader.io import roots as fs
from loader.lerobot.meta import LeRobotMeta
from loader.lerobot.sidecar import CompactIndex, SidecarError, ensure_sidecar, validate_sidecar
from loader.lerobot.sidecar.ensure import sidecar_cache_path
from loader.lerobot.sidecar.publish_layout import PublishError
from loader.lerobot.sidecar.published import fetch_published, published_home
from loader.lerobot.sidecar.schema import public_root

from .byte_cache import EpisodeByteCache
from .collate import batched, raw_frames
from .control import read_control
from .executor import EpisodePayload, PlanRunner, RunCounters
from .items import (
    EpisodeRows,
    build_item,
    check_delta_timestamps,
    delta_indices,
    frames_to_tensor,
    mark_padding,
)
from .monitor import PUBLISH_EVERY_S
from .options import DEFAULT_SEED, StreamingOptions
from .ownership import EpisodeWork, Ownership, batches_of, max_workers
from .planner import WorkerPlan, plan_worker
from .ranges import FetchCounters, RangeFetcher
from .state import (
    Layout,
    ResumePoint,
    StreamResumeError,
    make_state,
    parse_state,
    selection_fingerprint,
    worker_steps,
)
from .tabular import EpisodeTableReader
from .video import DecoderCache, EpisodeVideo, Frames, VideoSpan, frames_held, plan_video_span

log = logging.getLogger(__name__)


class EpisodeSelectionError(ValueError):
    """``episodes=`` selects no episode, or episodes the dataset does not have."""


@dataclass(frozen=True)
class EpochSetup:
    """How this epoch's plans are made: the layout, and the exact resume point if one applies."""

    epoch: int
    num_workers: int
    layout: Layout
    point: ResumePoint | None

# Counters shared with the main process (one row per worker), in this order.
STAT_FIELDS = ("samples", "padding_samples", "episodes_fetched", "bytes_fetched", "requests", "retries",
               "decode_ns", "frames_decoded", "wait_ns", "reserved_bytes", "resident_bytes",
               "budget_bytes", "peak_reserved_bytes")


class StreamingLeRobotDataset(IterableDataset):
    """A ``torch.utils.data.IterableDataset`` yielding what ``LeRobotDataset.__getitem__`` gives,
    plus ``__pad__`` (a 0-d bool: true on a repeat that evens out the ranks' batches).

    ``root``: a folder, ``s3://bucket/prefix``, ``http(s)://...`` or
    ``hf://datasets/OWNER/NAME[@rev]`` (default: the Hub dataset ``repo_id`` at ``revision``);
    metadata and payload come from it, a Hub root pinned to one commit. ``revision`` names the
    dataset revision the MP4 sidecar is keyed by (a Hub root's commit when not given).
    ``streaming_options`` are StreamingOptions' fields (LeRobot's names and defaults).
    ``stream_config`` tunes remote reads (retries, endpoints, credentials source).
    ``sidecar``: use this MP4 sidecar NPZ instead of finding one (it must validate against the
    dataset: an invalid one is an error, never silently rebuilt), e.g. to check a publish.
    ``sidecar_cache_root`` / ``index_cache_root`` default to ``$HF_LEROBOT_HOME``'s
    ``mp4-sidecars`` and ``streaming-indexes``.
    """

    def __init__(self, repo_id: str, *, root: str | os.PathLike[str] | None = None, revision: str | None = None,
                 episodes: Sequence[int] | None = None,
                 delta_timestamps: Mapping[str, Sequence[float]] | None = None, tolerance_s: float = 1e-4,
                 image_transforms: Callable[[Any], Any] | None = None, seed: int | None = 1000,
                 stream_config: StreamConfig | None = None,
                 sidecar_cache_root: str | os.PathLike[str] | None = None,
                 index_cache_root: str | os.PathLike[str] | None = None,
                 sidecar: str | os.PathLike[str] | None = None,
                 **streaming_options: Any):
        super().__init__()
        self.options = StreamingOptions.from_kwargs(streaming_options)
        episodes = StreamingOptions.validate_episodes(episodes)
        delta_timestamps = StreamingOptions.validate_delta_timestamps(delta_timestamps)
        seed = DEFAULT_SEED if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer or None (None means {DEFAULT_SEED}), got {seed!r}")
        if not (isinstance(tolerance_s, int | float) and tolerance_s > 0):
            raise ValueError(f"tolerance_s must be a positive number, got {tolerance_s!r}")
        self.repo_id = repo_id
        self.seed = seed
        self.tolerance_s = float(tolerance_s)
        self.image_transforms = image_transforms
        self.stream_config = stream_config
        if root is None:
            root = f"hf://datasets/{repo_id}" + (f"@{revision}" if revision else "")
        self.meta = LeRobotMeta.load(root, config=stream_config, pin_revision=True)
        self.root = self.meta.root
        self.revision = revision or self.meta.revision
        self.fps = self.meta.fps
        self.video_keys = list(self.meta.video_keys)
        self.image_keys = [k for k, f in self.meta.features.items() if f.get("dtype") == "image"]
        self.episodes = self._select(episodes)
        self.lengths = [self.meta.episode(e).length for e in self.episodes]
        self.num_frames = int(sum(self.lengths))
        self.num_episodes = len(self.episodes)
        self.delta_timestamps = None if delta_timestamps is None else {k: list(v) for k, v in delta_timestamps.items()}
        if self.delta_timestamps is not None:
            unknown = sorted(set(self.delta_timestamps) - set(self.meta.features))
            if unknown:
                raise ValueError(f"delta_timestamps keys {unknown} are not features of {repo_id} "
                                 f"(features: {sorted(self.meta.features)})")
            check_delta_timestamps(self.delta_timestamps, self.fps, self.tolerance_s)
        self.delta_indices = delta_indices(self.delta_timestamps, self.fps)
        self.fingerprint = selection_fingerprint(repo_id, self.episodes, self.lengths, self.fps)
        self.rank, self.world_size = _rank_and_world()
        self.epoch = 0
        self.index_cache_root = index_cache_root
        self._resume: ResumePoint | None = None
        self._batch_size: int | None = None      # set by make_loader: resume arithmetic needs it
        self._drop_last = False                  # set by make_loader(drop_last=True): no padding
        # Set by make_loader (batch_size, drop_last): this process builds the batches itself
        # (``collate``), the DataLoader only moves them; None: yield items.
        self._collate: tuple[int, bool] | None = None
        self._control: torch.Tensor | None = None        # set by make_loader: the epoch setup for workers
        self._shared_refill: torch.Tensor | None = None  # per worker: refill-level histogram
        self._process: _ProcessCache | None = None       # what this process keeps across epochs
        self._shared_stats: torch.Tensor | None = None
        self._publish_due = 0.0                  # monotonic time of the next stats publish
        self._yielded = 0                        # in-process iteration: samples handed out this epoch
        self.byte_cache: EpisodeByteCache | None = None
        self.counters = RunCounters()
        self.fetch_counters = FetchCounters()
        self._decoders: DecoderCache | None = None
        self._last_plan: WorkerPlan | None = None
        self._setup: EpochSetup | None = None

        if not self.video_keys:
            self.sidecar_path = None
        elif sidecar is not None:
            self.sidecar_path = Path(sidecar)
            problems = validate_sidecar(self.sidecar_path, self.meta, repo_id=repo_id, revision=self.revision,
                                        require_complete=True, stream_config=stream_config)
            if problems:
                raise SidecarError(f"{self.sidecar_path}: not a usable MP4 sidecar of {repo_id}@{self.revision}: "
                                   + "; ".join(problems))
        else:
            self.sidecar_path = self._ensure_sidecar(sidecar_cache_root)
        if self.sidecar_path is not None:
            # Convert this rank's files once here, so DataLoader workers only map them.
            mine = Ownership.compute(self._work({}), world_size=self.world_size, num_workers=0,
                                     seed=self.seed).parts[self.rank][0]
            CompactIndex.open(self.sidecar_path, cache_root=index_cache_root,
                              files=self._video_files([w.episode for w in mine]),
                              lock_timeout_s=self.options.streaming_sidecar_lock_timeout_s).close()

    @classmethod
    def mixture(cls, mixture: Any, **options: Any) -> Any:
        """Several datasets as one weighted mixture: ``mixture`` is a ``loader.mixture.Mixture``
        whose sources are repo ids or ``{"repo_id": ..., "root": ...}`` (see
        ``streaming/mixture.py``); ``options`` are this constructor's (seed, delta_timestamps,
        streaming options, ...), the same for every dataset. Items carry ``dataset_index``."""
        from .mixture import StreamingLeRobotMixture

        return StreamingLeRobotMixture(mixture, **options)

    # -- setup ------------------------------------------------------------------------------------

    def _select(self, episodes: Sequence[int] | None) -> list[int]:
        available = self.meta.episode_indices.tolist()
        if episodes is None:
            return available
        chosen = sorted({int(e) for e in episodes})
        missing = sorted(set(chosen) - set(available))
        if missing:
            raise EpisodeSelectionError(f"episodes {missing[:10]} are not in {self.repo_id} at "
                                        f"{public_root(self.root)} ({len(available)} episodes, "
                                        f"{available[0]}..{available[-1]})")
        if not chosen:
            raise EpisodeSelectionError("episodes= selects no episode")
        return chosen

    def _ensure_sidecar(self, cache_root: str | os.PathLike[str] | None) -> Path:
        entry = sidecar_cache_path(cache_root, repo_id=self.repo_id, revision=self.revision, data_root=self.root)

        def published() -> Path | None:
            try:
                return fetch_published(published_home(self.repo_id, self.root), self.revision,
                                       entry.with_name("published-download.npz"), config=self.stream_config)
            except (PublishError, PermissionError, OSError) as e:
                log.warning("published MP4 sidecar of %s is not usable (%s); building one locally", self.repo_id, e)
                return None

        return ensure_sidecar(self.meta, repo_id=self.repo_id, revision=self.revision, cache_root=cache_root,
                              lock_timeout_s=self.options.streaming_sidecar_lock_timeout_s,
                              published=published, stream_config=self.stream_config)

    def _work(self, base: Mapping[int, int]) -> list[EpisodeWork]:
        return [EpisodeWork(e, n, base.get(e, 0)) for e, n in zip(self.episodes, self.lengths, strict=True)]

    def _video_files(self, episodes: Sequence[int]) -> list[str]:
        rels = set()
        for e in episodes:
            info = self.meta.episode(e)
            for key in self.video_keys:
                span = info.videos[key]
                rels.add(self.meta.video_rel(key, span.chunk, span.file))
        return sorted(rels)

    def _spans(self, index: CompactIndex | None, episodes: Sequence[int]) -> dict[int, dict[str, VideoSpan]]:
        out: dict[int, dict[str, VideoSpan]] = {}
        for e in episodes:
            info = self.meta.episode(e)
            spans = {}
            for key in self.video_keys:
                v = info.videos[key]
                rel = self.meta.video_rel(key, v.chunk, v.file)
                spans[key] = plan_video_span(rel, index.arrays(rel), from_timestamp=v.from_timestamp,
                                             length=info.length, fps=self.fps, tolerance_s=self.tolerance_s)
            out[e] = spans
        return out

    def _open_index(self, episodes: Sequence[int]) -> CompactIndex | None:
        if self.sidecar_path is None:
            return None
        return CompactIndex.open(self.sidecar_path, cache_root=self.index_cache_root,
                                 files=self._video_files(episodes),
                                 lock_timeout_s=self.options.streaming_sidecar_lock_timeout_s)

    def episode_bytes(self, episodes: Sequence[int] | None = None) -> dict[int, int]:
        """The exact MP4 bytes the reader fetches and holds for each episode (all cameras)."""
        eps = list(self.episodes if episodes is None else episodes)
        index = self._open_index(eps)
        try:
            spans = self._spans(index, eps) if index is not None else {e: {} for e in eps}
        finally:
            if index is not None:
                index.close()
        return {e: sum(s.nbytes for s in spans[e].values()) for e in eps}

    # -- configuration helpers ----------------------------------------------------------------------

    def num_workers_for(self, requested: int, world_size: int | None = None) -> int:
        """The DataLoader workers to use: ``requested``, at most the episodes the smallest rank owns."""
        if requested < 0:
            raise ValueError(f"num_workers must be >= 0, got {requested}")
        most = max_workers(self._work({}), world_size=world_size or self.world_size, seed=self.seed)
        return min(requested, most)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = epoch
        self._yielded = 0

    def layout(self, num_workers: int) -> Layout:
        return Layout(world_size=self.world_size, num_workers=num_workers, seed=self.seed,
                      strategy=self.options.streaming_sampling_strategy,
                      pool_size=self.options.streaming_episode_pool_size,
                      byte_budget=self.options.byte_budget)

    def samples_per_rank(self, num_workers: int = 0, batch_size: int | None = None) -> int:
        """Samples this rank yields in a fresh epoch (padding included), with ``num_workers``
        DataLoader workers batching ``batch_size`` (default: the loader's)."""
        return self._fresh_ownership(num_workers, batch_size).rank_samples(self.rank)

    def batches_per_rank(self, num_workers: int = 0, batch_size: int | None = None) -> int:
        """Batches every rank yields in a fresh epoch (the same on each, but with ``drop_last``)."""
        batch_size = batch_size or self._batch_size or 1
        own = self._fresh_ownership(num_workers, batch_size)
        counts = own.counts[self.rank] if num_workers > 1 else [own.rank_samples(self.rank)]
        return sum(batches_of(c, batch_size, self._drop_last) for c in counts)

    def _fresh_ownership(self, num_workers: int, batch_size: int | None) -> Ownership:
        return Ownership.compute(self._work({}), world_size=self.world_size, num_workers=num_workers, seed=self.seed,
                                 batch_size=batch_size or self._batch_size, pad=not self._drop_last)

    # -- resume -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Resume state of an in-process iteration (num_workers=0); a collective call under
        torch.distributed. With DataLoader workers use the loader ``make_loader`` returns."""
        samples = _all_gather_ints(self._yielded)
        setup = self._setup if self._setup is not None and self._setup.epoch == self.epoch else None
        layout = setup.layout if setup is not None else self.layout(0)
        return make_state(fingerprint=self.fingerprint, epoch=self.epoch, layout=layout, batch_size=None,
                          samples=samples, batches=None, drop_last=self._drop_last)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the epoch the state was taken in, from where it stopped (next iteration)."""
        point = parse_state(state, fingerprint=self.fingerprint)
        self.epoch = point.epoch
        self._resume = point
        self._setup = None

    def prepare_epoch(self, num_workers: int) -> EpochSetup:
        """Fix this epoch's layout before workers start (``make_loader`` calls it): after an
        elastic resume the replay of the old plans runs once here, not in every worker."""
        s = self._setup
        if s is not None and s.epoch == self.epoch and s.num_workers == num_workers:
            return s
        fresh = self.layout(num_workers)
        point = self._resume if self._resume is not None and self._resume.epoch == self.epoch else None
        self._resume = None
        if point is None:
            setup = EpochSetup(self.epoch, num_workers, fresh, None)
        else:
            old = point.layout
            keys = ("world_size", "num_workers", "seed", "strategy", "pool_size", "byte_budget")
            same = all(getattr(old, k) == getattr(fresh, k) for k in keys) and point.drop_last == self._drop_last
            if same and (num_workers <= 1 or point.batch_size == self._batch_size):
                setup = EpochSetup(self.epoch, num_workers, old, point)
            else:
                consumed = self._replay(point)
                base = dict(old.base)
                new_base = {e: base.get(e, 0) + consumed.get(e, 0) for e in self.episodes}
                new_base = tuple(sorted((e, s) for e, s in new_base.items() if s))
                layout = Layout(**{**fresh.__dict__, "base": new_base})
                log.info("resuming epoch %d with another configuration (%s -> %s): %d frames were handed "
                         "out, the rest of the epoch visits the remaining ones once", self.epoch,
                         {k: getattr(old, k) for k in keys}, {k: getattr(fresh, k) for k in keys},
                         sum(consumed.values()))
                setup = EpochSetup(self.epoch, num_workers, layout, None)
        self._setup = setup
        return setup

    def _ownership(self, layout: Layout, batch_size: int | None, drop_last: bool) -> Ownership:
        base = dict(layout.base)
        return Ownership.compute(self._work(base), world_size=layout.world_size, num_workers=layout.num_workers,
                                 seed=layout.seed, allow_empty=bool(base), batch_size=batch_size, pad=not drop_last)

    def _replay(self, point: ResumePoint) -> dict[int, int]:
        """Frames of each episode the state's configuration had handed out (padding excluded)."""
        old = point.layout
        own = self._ownership(old, point.batch_size, point.drop_last)
        sizes = self.episode_bytes()
        consumed: dict[int, int] = {}
        for r in range(old.world_size):
            steps, _ = worker_steps(point.samples[r], None if point.batches is None else point.batches[r],
                                    num_workers=old.num_workers, batch_size=point.batch_size, counts=own.counts[r],
                                    drop_last=point.drop_last)
            for w, n in enumerate(steps):
                if n:
                    for e, c in self._plan(own, old, r, w, sizes).consumed(n).items():
                        consumed[e] = consumed.get(e, 0) + c
        return consumed

    def _donor(self, own: Ownership, layout: Layout, rank: int, worker: int) -> EpisodeWork | None:
        if own.parts[rank][worker] or not own.count(rank, worker):
            return None
        left = [w for w in self._work(dict(layout.base)) if w.remaining > 0]
        return max(left, key=lambda w: (w.remaining, -w.episode))

    def _plan(self, own: Ownership, layout: Layout, rank: int, worker: int, sizes: Mapping[int, int]) -> WorkerPlan:
        pool, budget = layout.worker_pool()
        return plan_worker(list(own.parts[rank][worker]), quota=own.count(rank, worker), pool_size=pool, byte_budget=budget,
                           sizes=sizes, strategy=layout.strategy, seed=layout.seed, epoch=self.epoch,
                           rank=rank, worker=worker, donor=self._donor(own, layout, rank, worker))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        num_workers = info.num_workers if info is not None else 0
        worker_id = info.id if info is not None else 0
        if info is not None:
            # A forked worker inherits the training process's objects: keep the garbage
            # collector from traversing (and so copying-on-write) them in every collection.
            gc.freeze()
        if info is not None and self._control is not None:
            # The training process planned this epoch (a persistent worker's copy of the dataset
            # is from an earlier one): take its epoch and layout.
            self.epoch, setup = read_control(self._control)
            self._setup = setup
        else:
            setup = self.prepare_epoch(num_workers)
        layout = setup.layout
        own = self._ownership(layout, self._batch_size, self._drop_last)
        logical, start = worker_id, 0
        if setup.point is not None:
            point, r = setup.point, self.rank
            batches = None if point.batches is None else point.batches[r]
            steps, turn = worker_steps(point.samples[r], batches, num_workers=num_workers,
                                       batch_size=point.batch_size, counts=own.counts[r], drop_last=point.drop_last)
            if num_workers > 1:
                # The DataLoader starts with worker 0; the uninterrupted run's next batch came from
                # worker `turn`: rotate so the order continues.
                logical = (worker_id + turn) % num_workers
            start = steps[logical]
        share = self.options.per_worker(num_workers, len(self.video_keys))
        donor = self._donor(own, layout, self.rank, logical)
        plan_eps = sorted({w.episode for w in own.parts[self.rank][logical]} | ({donor.episode} if donor else set()))
        proc = self._process_cache(num_workers, share.http_connections)
        index, spans, arrays = proc.episodes(self, plan_eps)
        sizes = {e: sum(s.nbytes for s in spans[e].values()) for e in plan_eps}
        plan = self._plan(own, layout, self.rank, logical, sizes)
        self._last_plan = plan
        in_process = info is None
        if in_process:
            self._yielded = start
        self.byte_cache = cache = EpisodeByteCache(layout.worker_pool()[1])
        self.fetch_counters = FetchCounters()
        self.counters = RunCounters()
        fetcher, tables = proc.fetcher, proc.tables
        fetcher.counters = self.fetch_counters
        self._decoders = decoders = DecoderCache(share.decoder_cache)
        decoders_lock = threading.Lock()
        # Decoded frames held per open decoder (frames_held): what windows and the decode threads'
        # out-of-order requests read again. Nothing more: at 640x480 each frame is 0.9 MB, times
        # every open decoder of the worker.
        reach = [abs(d) for key, ds in (self.delta_indices or {}).items() if key in self.video_keys for d in ds]
        decode_threads = self.options.decode_threads(num_workers)
        keep_frames, pending_frames = frames_held(max(reach, default=0), decode_threads)
        frame_dtype = self.options.frame_dtype
        batching = self._collate
        transforms_here = self.image_transforms if not in_process else None
        if batching is not None and self.image_transforms is None:
            video_value = raw_frames     # converted once, into the batch
        elif frame_dtype == "float32":
            video_value = None           # LeRobot's float32 tensor per item
        else:
            def video_value(frames: Frames) -> torch.Tensor:
                return frames_to_tensor(frames, frame_dtype).squeeze(0)

        def fetch(ep: int) -> EpisodePayload:
            rows = EpisodeRows(tables.read(self.meta.episode(ep)), self.meta.features)
            videos = {}
            for key, span in spans[ep].items():
                videos[key] = fetcher.fetch(fs.url(self.root, span.rel), span.byte_start, span.nbytes)
            return EpisodePayload(ep, rows, videos, sum(len(v) for v in videos.values()))

        def video(ep: int, key: str, payload: EpisodePayload) -> EpisodeVideo:
            with decoders_lock:
                dec = decoders.get((ep, key))
                if dec is None:
                    span = spans[ep][key]
                    if span.rel not in arrays:
                        arrays[span.rel] = index.arrays(span.rel)
                    dec = EpisodeVideo(span, index.file(span.rel), arrays[span.rel], payload.videos[key],
                                       tolerance_s=self.tolerance_s, keep_frames=keep_frames,
                                       pending_frames=pending_frames)
                    decoders.put((ep, key), dec)
                return dec

        def assemble(step: int, payload: EpisodePayload) -> dict[str, Any]:
            ep = payload.episode
            info_e = self.meta.episode(ep)
            frame = int(plan.frames[step])

            def decode(key: str, times: list[float]) -> Frames:
                self.counters.frames_decoded += len(times)
                at = [info_e.videos[key].from_timestamp + t for t in times]
                while True:
                    dec = video(ep, key, payload)
                    try:
                        return dec.rgb_at(at)
                    except ValueError:
                        # Evicted from the decoder LRU by another thread meanwhile: open it again.
                        if not dec.closed:
                            raise

            item = build_item(payload.rows, frame, length=info_e.length, deltas=self.delta_indices,
                              video_keys=self.video_keys, decode=decode, tasks=self.meta.tasks,
                              image_keys=self.image_keys, image_transforms=transforms_here,
                              video_value=video_value)
            return mark_padding(item, step >= plan.real_steps)

        def release(ep: int) -> None:
            with decoders_lock:
                for key in self.video_keys:
                    decoders.discard((ep, key))

        runner = PlanRunner(plan, start=start, sizes=sizes, cache=cache, fetch=fetch, assemble=assemble,
                            on_release=release, fetch_threads=self.options.max_num_shards,
                            decode_threads=decode_threads,
                            queue_size=self.options.streaming_decoded_queue_size,
                            prefetch=self.options.streaming_prefetch_episodes, counters=self.counters)
        row = worker_id if info is not None else 0

        def items() -> Iterator[dict[str, Any]]:
            for item in runner:
                if in_process:
                    self._yielded += 1
                    if self.image_transforms is not None:
                        for key in (*self.video_keys, *self.image_keys):
                            item[key] = self.image_transforms(item[key])
                self._publish_stats(row)
                yield item

        try:
            yield from batched(items(), batching, self.video_keys, frame_dtype=frame_dtype, shared=not in_process)
        finally:
            self._publish_stats(row, final=True)
            with decoders_lock:
                decoders.clear()
        if in_process:
            # A finished pass: the next iteration is the next epoch.
            self.epoch += 1
            self._yielded = 0

    # -- monitoring ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """This process's counters (a worker's own, or the training process's with num_workers=0)."""
        c = self.counters
        f = self.fetch_counters.as_dict()
        out = {"samples": c.samples, "padding_samples": c.padding_samples, "episodes_fetched": c.episodes_fetched,
               "bytes_fetched": f["bytes_fetched"], "requests": f["requests"], "retries": f["retries"],
               "decode_ns": int(c.decode_seconds * 1e9), "wait_ns": int(c.wait_seconds * 1e9),
               "frames_decoded": c.frames_decoded}
        snap = self.byte_cache.snapshot() if self.byte_cache is not None else {}
        for k in ("reserved_bytes", "resident_bytes", "budget_bytes", "peak_reserved_bytes"):
            out[k] = int(snap.get(k, 0))
        return out

    def _publish_stats(self, row: int, *, final: bool = False) -> None:
        """This process's counters into the loader's shared row ``row``: at most every
        ``PUBLISH_EVERY_S`` while iterating, and always at the end of a pass (``final``)."""
        t = self._shared_stats
        if t is None or row >= t.shape[0]:
            return
        now = time.monotonic()
        if not final and now < self._publish_due:
            return
        self._publish_due = now + PUBLISH_EVERY_S
        s = self.stats()
        t[row] = torch.tensor([s.get(k, 0) for k in STAT_FIELDS], dtype=torch.int64)
        h, refill = self._shared_refill, self.counters.refill
        if h is not None and row < h.shape[0] and refill:
            n = min(len(refill), h.shape[1])
            h[row, :n] = torch.tensor(refill[:n], dtype=torch.int64)

    def _process_cache(self, num_workers: int, http_connections: int | None) -> _ProcessCache:
        """This process's fetcher, footer cache and compact index: made once per process (a
        persistent worker, or the training process reading itself) and kept across epochs."""
        p = self._process
        if p is None or p.pid != os.getpid() or p.num_workers != num_workers:
            fetcher = RangeFetcher(config=self.stream_config, http_connections=http_connections,
                                   http_subranges=self.options.streaming_native_http_subranges)
            # Every data file's footer once per process (a file's footer and tail are <= 64 KiB).
            files = {(self.meta.episode(e).data_chunk, self.meta.episode(e).data_file) for e in self.episodes}
            tables = EpisodeTableReader(self.meta, fetcher, footer_cache=min(256, max(16, len(files))))
            p = self._process = _ProcessCache(os.getpid(), num_workers, fetcher, tables)
        return p

    def __getstate__(self) -> dict[str, Any]:
        # A worker builds its own (open files, threads); the training process keeps its own.
        return {**self.__dict__, "_process": None}


class _ProcessCache:
    """Per process, across epochs: the range fetcher, the parquet footers (EpisodeTableReader)
    and the compact index with the spans of the episodes this process reads."""

    def __init__(self, pid: int, num_workers: int, fetcher: RangeFetcher, tables: EpisodeTableReader):
        self.pid, self.num_workers, self.fetcher, self.tables = pid, num_workers, fetcher, tables
        self._key: tuple[int, ...] | None = None
        self._index: CompactIndex | None = None
        self._spans: dict[int, dict[str, VideoSpan]] = {}
        self.arrays: dict[str, Any] = {}

    def episodes(self, ds: StreamingLeRobotDataset, eps: Sequence[int]) -> tuple[CompactIndex | None, dict, dict]:
        key = tuple(eps)
        if key != self._key:
            if self._index is not None:
                self._index.close()
            self._index = ds._open_index(list(eps)) if eps else None
            self._spans = ds._spans(self._index, list(eps)) if self._index is not None else {e: {} for e in eps}
            self.arrays = {}
            self._key = key
        return self._index, self._spans, self.arrays


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_ints(value: int) -> list[int]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, int(value))
        return [int(v) for v in out]
    return [int(value)]


__all__ = ["STAT_FIELDS", "StreamResumeError", "StreamingLeRobotDataset"]
