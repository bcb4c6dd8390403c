"""Weighted mixtures of LeRobot datasets: ``StreamingLeRobotDataset.mixture(Mixture([...]))``.

Several v3 datasets (repo ids with roots) blended by ``weight``, ``repeat`` or ``choose``, with
the definition, the counts per epoch and the interleave of ``loader.mixture`` (one
implementation for twin tars and LeRobot):

* **Each dataset's own order** is what ``StreamingLeRobotDataset`` of that dataset alone yields
  in one stream (one rank, no workers) with the same seed and options: its episode pool, byte
  budget and sampling strategy, planned over its own MP4 sidecar (``planner.plan_worker``).
* **The mixture's order** of an epoch is the Sainte-Laguë interleave of those orders
  (``loader.mixture.schedule.Schedule``): every prefix holds each dataset's share within ±1
  item; ``repeat`` and ``choose`` map a dataset's j-th item to its passes as twin-tar mixtures
  do (``loader.mixture.order.source_passes``), so ``choose`` takes other frames each epoch,
  each once. It is a pure function of (seed, epoch, the datasets' episode selections and
  sidecars, the definition, the options): never of the world size or the worker count.
* **Dealing** is the twin-tar loader's (``loader.wds.epoch_plan.EpochPlan``): the order cut
  into batches of the loader's batch size (1 when it yields items), rank r takes batch
  ``k * ranks + r`` in step k, the last step split so every rank has as many batches (repeats
  of the epoch's first items, marked ``__pad__``), and a rank's batch k is built by DataLoader
  worker ``k mod workers``, the order in which the DataLoader collects them.
* **Resume**: the state is the epoch, the positions consumed before the current plan (a few
  intervals) and each rank's items handed out; ``load_state_dict`` under any world size, worker
  count or batch size re-deals what is left of the same order, so the rest of the epoch is
  exactly what the uninterrupted run would have read. A state taken with another definition
  (sources, weights, episode selections) is refused, naming what changed.

Items are ``LeRobotDataset.__getitem__``'s of their dataset (pixel-equal to the dataset read
alone), plus ``dataset_index`` (a 0-d int64 tensor: the dataset's place in the mixture, as
LeRobot's ``MultiLeRobotDataset`` gives), ``__pad__`` and ``__repeat__`` (0-d int64: how many
times this frame came before in this epoch, > 0 for ``repeat`` > 1).

The price of an order independent of the layout: a worker reads the items of its batches,
wherever they are in the datasets' pools, so an episode is fetched by every worker that has
one of its frames in a batch (up to ranks x workers times, where a single dataset's reader
fetches it once), and a worker may hold up to every dataset's whole pool at once.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from loader.formats.errors import short_repr
from loader.io import StreamConfig
from loader.io import roots as fs
from loader.mixture.definition import Mixture, MixtureError, Source
from loader.mixture.order import source_passes, window_start
from loader.mixture.schedule import Schedule
from loader.mixture.shardlist import definition_changes
from loader.wds.epoch_plan import EpochPlan
from loader.wds.epoch_plan import Layout as OrderLayout
from loader.wds.errors import ResumeStateError

from .byte_cache import EpisodeByteCache
from .collate import batched, raw_frames
from .control import read_control
from .dataset import (
    EpisodeSelectionError,
    StreamingLeRobotDataset,
    _all_gather_ints,
    _rank_and_world,
)
from .executor import EpisodePayload, PlanRunner, RunCounters
from .items import EpisodeRows, build_item, frames_to_tensor, mark_padding
from .monitor import PUBLISH_EVERY_S
from .options import DEFAULT_SEED, StreamingOptions
from .planner import WorkerPlan, plan_worker
from .ranges import FetchCounters
from .state import StreamResumeError
from .video import DecoderCache, EpisodeVideo, Frames, frames_held

STATE_FORMAT = "pid-lerobot-mixture"
STATE_VERSION = 1
DATASET_INDEX_KEY = "dataset_index"
REPEAT_KEY = "__repeat__"
SPEC_KEYS = ("repo_id", "root", "revision", "episodes", "sidecar")
# A worker's plan names an episode of dataset i as i * _STRIDE + episode (one id space for the runner).
_STRIDE = 1 << 32
# Per-worker counters shared with the training process: STAT_FIELDS' own, then one per dataset.
MIX_STAT_FIELDS = ("samples", "padding_samples", "episodes_fetched", "bytes_fetched", "requests", "retries",
                   "decode_ns", "frames_decoded", "wait_ns", "reserved_bytes", "resident_bytes",
                   "budget_bytes", "peak_reserved_bytes")


class MixtureResumeError(StreamResumeError, ResumeStateError):
    """A resume state that is malformed or was taken with another mixture definition (both the
    LeRobot reader's ``StreamResumeError`` and the twin-tar mixtures' ``ResumeStateError``)."""


@dataclass(frozen=True)
class MixtureSetup:
    """How this epoch's plan is made: the batch size it is cut into and what was consumed."""

    epoch: int
    block: int
    drop_last: bool
    consumed: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _ResumePoint:
    epoch: int
    world_size: int
    block: int
    drop_last: bool
    consumed: tuple[tuple[int, int], ...]
    samples: tuple[int, ...]


class LeRobotMixtureOrder:
    """Position -> (dataset, episode, frame, pass) for one epoch of a LeRobot mixture; what
    ``EpochPlan`` deals (``size``, ``chunked``, ``layout``)."""

    chunked = False

    def __init__(self, plans: Sequence[WorkerPlan], per_epoch: Sequence[int], *, seed: int, epoch: int,
                 layout: OrderLayout):
        self.plans, self.per_epoch, self.seed, self.epoch, self.layout = list(plans), list(per_epoch), seed, epoch, layout
        self.schedule = Schedule(list(per_epoch), seed=seed, epoch=epoch)
        self.size = self.schedule.size

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        src, j = self.schedule.at(np.asarray(positions, np.int64))
        episodes, frames, passes = (np.empty(len(j), np.int64) for _ in range(3))
        for i in np.unique(src).tolist():
            sel = np.flatnonzero(src == i)
            n = len(self.plans[i])
            k, local = source_passes(j[sel], n, self.per_epoch[i],
                                     lambda i=i, n=n: window_start(self.seed, self.epoch, i, n))
            episodes[sel], frames[sel], passes[sel] = self.plans[i].episodes[local], self.plans[i].frames[local], k
        return src, episodes, frames, passes


def _spec(mix: Mixture, source: Source) -> dict[str, Any]:
    spec = source.spec
    if isinstance(spec, str):
        return {"repo_id": spec}
    if isinstance(spec, Mapping):
        extra = sorted(set(spec) - set(SPEC_KEYS))
        if extra or not isinstance(spec.get("repo_id"), str):
            raise mix.error(f"{dict(spec)!r} is not a LeRobot dataset" + (f" (unknown keys {extra})" if extra else ""),
                            f"give {{'repo_id': 'OWNER/NAME', 'root': ...}} with keys from {list(SPEC_KEYS)}", source)
        return dict(spec)
    raise mix.error(f"{spec!r} is not a LeRobot dataset",
                    "give a repo id, or {'repo_id': 'OWNER/NAME', 'root': '/data/...'}", source)


def _features_differ(a: StreamingLeRobotDataset, b: StreamingLeRobotDataset) -> str:
    """The first way ``b``'s frames differ from ``a``'s ('' if they agree)."""
    if a.fps != b.fps:
        return f"fps {b.fps}, the first dataset {a.fps}"
    fa, fb = a.meta.features, b.meta.features
    missing, extra = [k for k in fa if k not in fb], [k for k in fb if k not in fa]
    if missing or extra:
        what = [f"lacks {missing}"] if missing else []
        what += [f"has {extra} besides"] if extra else []
        return "features differ: it " + " and ".join(what)
    for key in fa:
        for field in ("dtype", "shape"):
            va, vb = fa[key].get(field), fb[key].get(field)
            if field == "shape":
                va, vb = list(va or []), list(vb or [])
            if va != vb:
                return f"feature {key!r} has {field} {vb!r}, the first dataset {va!r}"
    return ""


class StreamingLeRobotMixture(IterableDataset):
    """Several LeRobot datasets streamed as one weighted mixture (see the module docstring);
    made by ``StreamingLeRobotDataset.mixture``. ``datasets[i]`` is dataset i's own reader
    (its metadata, sidecar, episode selection), ``sources[i]`` its ``Source``."""

    def __init__(self, mixture: Mixture, *, delta_timestamps: Mapping[str, Sequence[float]] | None = None,
                 tolerance_s: float = 1e-4, image_transforms: Callable[[Any], Any] | None = None,
                 seed: int | None = 1000, stream_config: StreamConfig | None = None,
                 sidecar_cache_root: str | os.PathLike[str] | None = None,
                 index_cache_root: str | os.PathLike[str] | None = None, **streaming_options: Any):
        super().__init__()
        if not isinstance(mixture, Mixture):
            raise TypeError(f"StreamingLeRobotDataset.mixture takes a loader.mixture.Mixture, got {type(mixture).__name__}")
        # Settings first: a bad option is the caller's, not one dataset's.
        self.options = StreamingOptions.from_kwargs(streaming_options)
        StreamingOptions.validate_delta_timestamps(delta_timestamps)
        self.mixture = mixture
        self.sources = tuple(mixture.sources)
        self.seed = DEFAULT_SEED if seed is None else seed
        self.image_transforms = image_transforms
        self.datasets: list[StreamingLeRobotDataset] = []
        for source in self.sources:
            spec = _spec(mixture, source)
            try:
                ds = StreamingLeRobotDataset(
                    spec["repo_id"], root=spec.get("root"), revision=spec.get("revision"),
                    episodes=spec.get("episodes"), sidecar=spec.get("sidecar"), delta_timestamps=delta_timestamps,
                    tolerance_s=tolerance_s, seed=seed, stream_config=stream_config,
                    sidecar_cache_root=sidecar_cache_root, index_cache_root=index_cache_root, **streaming_options)
            except MixtureError:
                raise
            except EpisodeSelectionError as exc:  # the root opened: the selection is what to fix
                raise mixture.error(f"its episodes {short_repr(spec.get('episodes'), 60)}: {exc}",
                                    "fix its 'episodes' (episode indices of that dataset; leave it out for every "
                                    "episode), or remove the source", source) from None
            except Exception as exc:  # what the single reader says, with the dataset and source named
                root = spec.get("root") or f"hf://datasets/{spec['repo_id']}"
                raise mixture.error(f"cannot be opened from root {str(root)!r} ({type(exc).__name__}: {exc})",
                                    "fix its 'root' (a folder, s3://..., hf://datasets/OWNER/NAME) or 'repo_id', "
                                    "or remove the source", source) from exc
            self.datasets.append(ds)
        first = self.datasets[0]
        for source, ds in zip(self.sources[1:], self.datasets[1:], strict=True):
            diff = _features_differ(first, ds)
            if diff:
                raise mixture.error(
                    f"{ds.repo_id} does not match {first.repo_id} (source {self.sources[0].label!r}): {diff}",
                    "every dataset of a LeRobot mixture needs the same fps and the same features (names, "
                    "dtypes, shapes): mix only datasets recorded alike, or convert this one", source)
        self.fps = first.fps
        self.video_keys = list(first.video_keys)
        self.image_keys = list(first.image_keys)
        self.delta_indices = first.delta_indices
        self.num_frames = [ds.num_frames for ds in self.datasets]
        self.per_epoch = mixture.counts(self.num_frames)
        if sum(self.per_epoch) == 0:
            raise mixture.error("gives no frame per epoch", "give some source a repeat or choose above 0")
        # Every camera file of every dataset converted to the compact index here, once, so
        # workers only map them; and each episode's exact MP4 bytes, which the pools plan with.
        self.episode_sizes = [ds.episode_bytes() for ds in self.datasets]
        self.rank, self.world_size = _rank_and_world()
        self.epoch = 0
        self._resume: _ResumePoint | None = None
        self._setup: MixtureSetup | None = None
        self._batch_size: int | None = None   # set by make_loader: the order is cut into its batches
        self._drop_last = False
        self._collate: tuple[int, bool] | None = None
        self._control: torch.Tensor | None = None
        self._shared_stats: torch.Tensor | None = None
        self._publish_due = 0.0                  # monotonic time of the next stats publish
        self._plans: tuple[int, list[WorkerPlan]] | None = None
        self._yielded = 0
        self.counters = RunCounters()
        self.fetch_counters = FetchCounters()
        self.byte_cache: EpisodeByteCache | None = None
        self.samples_per_source = [0] * len(self.sources)

    # -- the order ----------------------------------------------------------------------------------

    @property
    def source_names(self) -> list[str]:
        return [s.label for s in self.sources]

    def dataset_plans(self, epoch: int) -> list[WorkerPlan]:
        """Each dataset's own order of ``epoch``: its single-stream plan (one rank, no workers)."""
        if self._plans is not None and self._plans[0] == epoch:
            return self._plans[1]
        o = self.options
        plans = [plan_worker(ds._work({}), quota=ds.num_frames, pool_size=o.streaming_episode_pool_size,
                             byte_budget=o.byte_budget, sizes=sizes, strategy=o.streaming_sampling_strategy,
                             seed=self.seed, epoch=epoch, rank=0, worker=0)
                 for ds, sizes in zip(self.datasets, self.episode_sizes, strict=True)]
        self._plans = (epoch, plans)
        return plans

    def order(self, epoch: int, block: int = 1, drop_last: bool = False) -> LeRobotMixtureOrder:
        return LeRobotMixtureOrder(self.dataset_plans(epoch), self.per_epoch, seed=self.seed, epoch=epoch,
                                   layout=OrderLayout(block=block, drop_last=drop_last))

    def epoch_order(self, epoch: int | None = None) -> list[tuple[int, int]]:
        """(dataset_index, index) of every item of an epoch's order, before dealing."""
        e = self.epoch if epoch is None else epoch
        o = self.order(e)
        src, eps, frames, _ = o.locate(np.arange(o.size, dtype=np.int64))
        return [(i, self.datasets[i].meta.episode(ep).dataset_from_index + f)
                for i, ep, f in zip(src.tolist(), eps.tolist(), frames.tolist(), strict=True)]

    def _block(self) -> int:
        return self._batch_size or 1

    def definition(self) -> dict[str, Any]:
        mix = self.mixture
        return {
            "name": mix.name,
            "sources": [{"name": s.label, **s.to_json(), "samples": n, "per_epoch": c, "fingerprint": ds.fingerprint}
                        for s, ds, n, c in zip(self.sources, self.datasets, self.num_frames, self.per_epoch, strict=True)],
            "samples_per_epoch": sum(self.per_epoch),
            "seed": self.seed,
            "options": {k: getattr(self.options, k) for k in ("streaming_episode_pool_size", "streaming_byte_budget_gb",
                                                              "streaming_sampling_strategy")},
        }

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = epoch
        self._yielded = 0

    def prepare_epoch(self, num_workers: int = 0) -> MixtureSetup:
        """This epoch's setup (``make_loader`` calls it before workers start): after a resume, the
        positions the state's run had consumed, worked out once here."""
        block, drop_last = self._block(), self._drop_last
        s = self._setup
        point = self._resume if self._resume is not None and self._resume.epoch == self.epoch else None
        if point is None and s is not None and (s.epoch, s.block, s.drop_last) == (self.epoch, block, drop_last):
            return s
        consumed: tuple[tuple[int, int], ...] = ()
        if point is not None:
            self._resume = None
            old = EpochPlan(self.order(point.epoch, point.block, point.drop_last), list(point.consumed),
                            point.world_size)
            progress = {r: old.progress(r, n) for r, n in enumerate(point.samples)}
            consumed = tuple((int(a), int(b)) for a, b in old.consumed_after(progress))
        self._setup = MixtureSetup(self.epoch, block, drop_last, consumed)
        return self._setup

    def rank_plan(self, setup: MixtureSetup) -> EpochPlan:
        return EpochPlan(self.order(setup.epoch, setup.block, setup.drop_last), list(setup.consumed), self.world_size)

    def samples_per_rank(self, num_workers: int = 0, batch_size: int | None = None) -> int:
        """Items this rank yields in a fresh epoch (padding included)."""
        return EpochPlan(self.order(self.epoch, batch_size or self._block(), self._drop_last), [],
                         self.world_size).rank_samples(self.rank)

    def batches_per_rank(self, num_workers: int = 0, batch_size: int | None = None) -> int:
        return EpochPlan(self.order(self.epoch, batch_size or self._block(), self._drop_last), [],
                         self.world_size).batches_per_rank

    def num_workers_for(self, requested: int, world_size: int | None = None) -> int:
        """Any worker count works (a worker with no batch yields nothing)."""
        if requested < 0:
            raise ValueError(f"num_workers must be >= 0, got {requested}")
        return requested

    # -- resume -------------------------------------------------------------------------------------

    def make_state(self, samples: Sequence[int]) -> dict[str, Any]:
        s = self._setup if self._setup is not None and self._setup.epoch == self.epoch else None
        if s is None:
            s = MixtureSetup(self.epoch, self._block(), self._drop_last, ())
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "mixture": self.definition(),
                "epoch": int(self.epoch), "world_size": self.world_size, "block": s.block,
                "drop_last": s.drop_last, "consumed": [list(c) for c in s.consumed],
                "samples": [int(n) for n in samples]}

    def state_dict(self) -> dict[str, Any]:
        """Resume state of an in-process iteration (num_workers=0); a collective call under
        torch.distributed. With DataLoader workers use the loader ``make_loader`` returns."""
        return self.make_state(_all_gather_ints(self._yielded))

    def parse_state(self, state: Any) -> _ResumePoint:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise MixtureResumeError(f"not a LeRobot mixture resume state (no 'format': {STATE_FORMAT!r}); "
                                     "was it taken from another loader?")
        if state.get("version") != STATE_VERSION:
            raise MixtureResumeError(f"resume state field 'version' is {state.get('version')!r}; this reader "
                                     f"reads version {STATE_VERSION}")
        changed = definition_changes(self.definition(), state.get("mixture"))
        saved = state.get("mixture") or {}
        if not changed and isinstance(saved, dict):
            for key in ("seed", "options"):
                if saved.get(key) != self.definition()[key]:
                    changed = f"{key} {saved.get(key)!r} -> {self.definition()[key]!r}"
        if changed:
            raise MixtureResumeError(f"dataset {self.mixture.name!r}: the resume state was taken with another "
                                     f"definition ({changed}); resume with the definition it was taken with, "
                                     "or start the epoch afresh")

        def whole(name: str, minimum: int) -> int:
            v = state.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise MixtureResumeError(f"resume state field {name!r} must be an integer >= {minimum}, got {v!r}")
            return v

        world = whole("world_size", 1)
        samples, consumed = state.get("samples"), state.get("consumed")
        if (not isinstance(samples, list) or len(samples) != world
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in samples)):
            raise MixtureResumeError(f"resume state field 'samples' must list one count >= 0 per rank ({world}), "
                                     f"got {samples!r}")
        if not isinstance(consumed, list) or any(not isinstance(c, list | tuple) or len(c) != 2 for c in consumed):
            raise MixtureResumeError(f"resume state field 'consumed' must be [start, stop] pairs, got {consumed!r}")
        drop_last = state.get("drop_last")
        if not isinstance(drop_last, bool):
            raise MixtureResumeError(f"resume state field 'drop_last' must be true or false, got {drop_last!r}")
        return _ResumePoint(whole("epoch", 0), world, whole("block", 1), drop_last,
                            tuple((int(a), int(b)) for a, b in consumed), tuple(samples))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the epoch the state was taken in, from where it stopped (next iteration)."""
        point = self.parse_state(state)
        self.epoch = point.epoch
        self._resume = point
        self._setup = None
        self._yielded = 0

    # -- reading ------------------------------------------------------------------------------------

    def worker_steps(self, setup: MixtureSetup, num_workers: int, worker: int) -> dict[str, np.ndarray]:
        """What worker ``worker`` of this rank yields, in order: position, dataset, episode,
        frame, pass and pad flag of each item (its batches k = worker, worker + workers, ...)."""
        plan = self.rank_plan(setup)
        n = max(1, num_workers)
        pos, pad = [np.zeros(0, np.int64)], [np.zeros(0, bool)]
        for k in range(worker, plan.batches_per_rank, n):
            p, f = plan.positions(self.rank, k)
            pos.append(p)
            pad.append(f)
        positions, pads = np.concatenate(pos), np.concatenate(pad)
        src, eps, frames, passes = plan.order.locate(positions)  # type: ignore[attr-defined]
        return {"positions": positions, "sources": src, "episodes": eps, "frames": frames, "passes": passes,
                "pads": pads}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        num_workers = info.num_workers if info is not None else 0
        worker_id = info.id if info is not None else 0
        in_process = info is None
        if not in_process:
            gc.freeze()  # as the single reader: no copy-on-write of the parent's objects
        if not in_process and self._control is not None:
            self.epoch, setup = read_control(self._control)
            self._setup = setup
        else:
            setup = self.prepare_epoch(num_workers)
        steps = self.worker_steps(setup, num_workers, worker_id)
        src, eps, frames, passes, pads = (steps[k] for k in ("sources", "episodes", "frames", "passes", "pads"))
        ids = src * _STRIDE + eps
        if pads.any() and not pads[int(np.argmax(pads)):].all():
            raise AssertionError("padding is not at the end of a worker's steps")
        # Fetch order: episodes as their first item comes; the byte cache holds what the plan
        # has open at its fullest (never more than every dataset's pool, bar the wrap of a
        # partial pass and the tail's padding).
        uniq, first = np.unique(ids, return_index=True)
        _, last = np.unique(ids[::-1], return_index=True)
        last = len(ids) - 1 - last
        by_first = np.argsort(first, kind="stable")
        admit_order = tuple(int(uniq[i]) for i in by_first)
        admit_step = tuple(int(first[i]) for i in by_first)
        sizes = {int(c): int(self.episode_sizes[int(c) // _STRIDE][int(c) % _STRIDE]) for c in uniq.tolist()}
        delta = np.zeros(len(ids) + 1, np.int64)
        for c, a, b in zip(uniq.tolist(), first.tolist(), last.tolist(), strict=True):
            delta[a] += sizes[c]
            delta[b + 1] -= sizes[c]
        peak = int(np.cumsum(delta).max()) if len(ids) else 0
        plan = WorkerPlan(episodes=ids, frames=frames, padding=int(pads.sum()), admit_order=admit_order,
                          admit_step=admit_step)
        share = self.options.per_worker(num_workers, len(self.video_keys))
        procs: dict[int, tuple[Any, Any, Any, Any]] = {}
        for i, ds in enumerate(self.datasets):
            mine = sorted({int(e) for e in eps[src == i].tolist()})
            if mine:
                proc = ds._process_cache(num_workers, share.http_connections)
                index, spans, arrays = proc.episodes(ds, mine)
                procs[i] = (proc, index, spans, arrays)
        self.byte_cache = cache = EpisodeByteCache(max(1, peak))
        self.fetch_counters = FetchCounters()
        self.counters = RunCounters()
        self.samples_per_source = [0] * len(self.sources)
        for proc, *_ in procs.values():
            proc.fetcher.counters = self.fetch_counters
        decoders = DecoderCache(max(1, share.decoder_cache * len(self.datasets)))
        decoders_lock = threading.Lock()
        reach = [abs(d) for key, ds_ in (self.delta_indices or {}).items() if key in self.video_keys for d in ds_]
        decode_threads = self.options.decode_threads(num_workers)
        keep_frames, pending_frames = frames_held(max(reach, default=0), decode_threads)
        frame_dtype = self.options.frame_dtype
        batching = self._collate
        transforms_here = self.image_transforms if not in_process else None
        video_value: Callable[[Frames], Any] | None
        if batching is not None and self.image_transforms is None:
            video_value = raw_frames
        elif frame_dtype == "float32":
            video_value = None
        else:
            def video_value(f: Frames) -> torch.Tensor:
                return frames_to_tensor(f, frame_dtype).squeeze(0)

        def fetch(cid: int) -> EpisodePayload:
            i, ep = divmod(cid, _STRIDE)
            ds, (proc, _, spans, _) = self.datasets[i], procs[i]
            rows = EpisodeRows(proc.tables.read(ds.meta.episode(ep)), ds.meta.features)
            videos = {key: proc.fetcher.fetch(fs.url(ds.root, span.rel), span.byte_start, span.nbytes)
                      for key, span in spans[ep].items()}
            return EpisodePayload(cid, rows, videos, sum(len(v) for v in videos.values()))

        def video(cid: int, key: str, payload: EpisodePayload) -> EpisodeVideo:
            i, ep = divmod(cid, _STRIDE)
            _, index, spans, arrays = procs[i]
            with decoders_lock:
                dec = decoders.get((cid, key))
                if dec is None:
                    span = spans[ep][key]
                    if span.rel not in arrays:
                        arrays[span.rel] = index.arrays(span.rel)
                    dec = EpisodeVideo(span, index.file(span.rel), arrays[span.rel], payload.videos[key],
                                       tolerance_s=self.datasets[i].tolerance_s, keep_frames=keep_frames,
                                       pending_frames=pending_frames)
                    decoders.put((cid, key), dec)
                return dec

        def assemble(step: int, payload: EpisodePayload) -> dict[str, Any]:
            cid = payload.episode
            i, ep = divmod(cid, _STRIDE)
            ds = self.datasets[i]
            info_e = ds.meta.episode(ep)

            def decode(key: str, times: list[float]) -> Frames:
                self.counters.frames_decoded += len(times)
                at = [info_e.videos[key].from_timestamp + t for t in times]
                while True:
                    dec = video(cid, key, payload)
                    try:
                        return dec.rgb_at(at)
                    except ValueError:
                        if not dec.closed:  # evicted by another thread meanwhile: open it again
                            raise

            item = build_item(payload.rows, int(frames[step]), length=info_e.length, deltas=self.delta_indices,
                              video_keys=self.video_keys, decode=decode, tasks=ds.meta.tasks,
                              image_keys=self.image_keys, image_transforms=transforms_here, video_value=video_value)
            item[DATASET_INDEX_KEY] = torch.tensor(i)
            mark_padding(item, bool(pads[step]))
            item[REPEAT_KEY] = torch.tensor(int(passes[step]))
            return item

        def release(cid: int) -> None:
            with decoders_lock:
                for key in self.video_keys:
                    decoders.discard((cid, key))

        runner = PlanRunner(plan, start=0, sizes=sizes, cache=cache, fetch=fetch, assemble=assemble,
                            on_release=release, fetch_threads=self.options.max_num_shards,
                            decode_threads=decode_threads, queue_size=self.options.streaming_decoded_queue_size,
                            prefetch=self.options.streaming_prefetch_episodes, counters=self.counters)
        row = worker_id if not in_process else 0

        def items() -> Iterator[dict[str, Any]]:
            for step, item in enumerate(runner):
                self.samples_per_source[int(src[step])] += 1
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
            self.epoch += 1
            self._yielded = 0

    # -- monitoring ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """This process's counters, and ``samples_per_source`` (items per source, by name)."""
        c, f = self.counters, self.fetch_counters.as_dict()
        out: dict[str, Any] = {
            "samples": c.samples, "padding_samples": c.padding_samples, "episodes_fetched": c.episodes_fetched,
            "bytes_fetched": f["bytes_fetched"], "requests": f["requests"], "retries": f["retries"],
            "decode_ns": int(c.decode_seconds * 1e9), "frames_decoded": c.frames_decoded,
            "wait_ns": int(c.wait_seconds * 1e9)}
        snap = self.byte_cache.snapshot() if self.byte_cache is not None else {}
        for k in ("reserved_bytes", "resident_bytes", "budget_bytes", "peak_reserved_bytes"):
            out[k] = int(snap.get(k, 0))
        out["samples_per_source"] = dict(zip(self.source_names, self.samples_per_source, strict=True))
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
        t[row] = torch.tensor([s.get(k, 0) for k in MIX_STAT_FIELDS] + list(self.samples_per_source),
                              dtype=torch.int64)


__all__ = ["DATASET_INDEX_KEY", "REPEAT_KEY", "LeRobotMixtureOrder", "MixtureResumeError",
           "StreamingLeRobotMixture"]
