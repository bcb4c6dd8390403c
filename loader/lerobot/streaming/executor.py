"""Runs one worker's plan: fetches episodes under the byte budget, decodes on threads, yields
samples in plan order.

Three kinds of threads, one job each:

* the admission thread walks the plan's fetch order, takes a byte reservation for each episode
  (waiting while the budget is full) and hands it to the fetch pool; it runs at most
  ``streaming_prefetch_episodes`` episodes ahead of the pool the plan has admitted by then;
* the fetch pool (``max_num_shards`` threads) reads an episode's parquet rows and the MP4 byte
  span of each camera;
* the decode pool (``streaming_decode_threads``) assembles samples; at most
  ``streaming_decoded_queue_size`` of them are in flight, and they are yielded in plan order.

Reservations are taken in fetch order and released when the last sample reading an episode is
assembled. The plan admits an episode only when the budget holds it beside the episodes still
resident, and every sample before that step reads only earlier episodes, so the reservation an
episode waits for is always released by samples already in flight: the pipeline cannot
deadlock, and ``reserved_bytes`` never exceeds the budget.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .byte_cache import EpisodeByteCache
from .planner import WorkerPlan


@dataclass
class EpisodePayload:
    """What one fetched episode holds: its rows (converted) and each camera's span bytes."""

    episode: int
    rows: Any
    videos: dict[str, bytes]
    nbytes: int


@dataclass
class RunCounters:
    samples: int = 0
    padding_samples: int = 0
    episodes_fetched: int = 0
    frames_decoded: int = 0            # video frames handed to samples (windows count each frame)
    decode_seconds: float = 0.0
    fetch_seconds: float = 0.0
    wait_seconds: float = 0.0          # time the consumer waited for the next sample
    # refill[k]: samples taken while k of the decoded window's samples were ready (the
    # refill level; at 0 the consumer waits on the decoder)
    refill: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class PlanRunner:
    """Iterate ``plan`` from step ``start``; ``fetch(ep)`` returns an EpisodePayload,
    ``assemble(step, payload)`` the sample, ``on_release(ep)`` drops per-episode state."""

    def __init__(self, plan: WorkerPlan, *, start: int, sizes: dict[int, int], cache: EpisodeByteCache,
                 fetch: Callable[[int], EpisodePayload],
                 assemble: Callable[[int, EpisodePayload], Any],
                 on_release: Callable[[int], None],
                 fetch_threads: int, decode_threads: int, queue_size: int, prefetch: int,
                 counters: RunCounters | None = None):
        self.plan = plan
        self.start = start
        self.sizes = sizes
        self.cache = cache
        self._fetch = fetch
        self._assemble = assemble
        self._on_release = on_release
        self.fetch_threads = fetch_threads
        self.decode_threads = decode_threads
        self.queue_size = queue_size
        self.prefetch = prefetch
        self.counters = counters or RunCounters()
        uses = plan.uses_from(start)
        # The fetch order restricted to episodes still read from `start` on.
        steps = dict(zip(plan.admit_order, plan.admit_step, strict=True))
        self.order = [ep for ep in plan.admit_order if ep in uses]
        self.order_step = [steps[ep] for ep in self.order]
        self._uses_left = dict(uses)
        self._uses_lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._cond = threading.Condition()
        self._progress = start          # the step the consumer has reached
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # -- admission ---------------------------------------------------------------------------------

    def _allowed(self) -> int:
        """How many episodes (in fetch order) may be reserved now."""
        horizon = self._progress + self.queue_size
        admitted = sum(1 for s in self.order_step if s <= horizon)
        return admitted + self.prefetch

    def _admit_loop(self, fetch_pool: ThreadPoolExecutor) -> None:
        try:
            for j, ep in enumerate(self.order):
                with self._cond:
                    while j >= self._allowed() and not self._stop.is_set():
                        self._cond.wait(0.1)
                if self._stop.is_set():
                    return
                if not self.cache.reserve(ep, self.sizes[ep], self._stop):
                    return
                fut = fetch_pool.submit(self._fetch_one, ep)
                with self._cond:
                    self._futures[ep] = fut
                    self._cond.notify_all()
        except BaseException as e:  # surfaced to the consumer
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _fetch_one(self, ep: int) -> EpisodePayload:
        t0 = time.perf_counter()
        payload = self._fetch(ep)
        self.counters.fetch_seconds += time.perf_counter() - t0
        self.counters.episodes_fetched += 1
        self.cache.put(ep, payload, payload.nbytes)
        return payload

    # -- consumption -------------------------------------------------------------------------------

    def _future_of(self, ep: int) -> Future:
        with self._cond:
            while ep not in self._futures:
                if self._error is not None:
                    raise self._error
                self._cond.wait(0.1)
            return self._futures[ep]

    def _run_step(self, step: int, fut: Future) -> Any:
        payload = fut.result()
        ep = int(self.plan.episodes[step])
        t0 = time.perf_counter()
        try:
            return self._assemble(step, payload)
        finally:
            self.counters.decode_seconds += time.perf_counter() - t0
            with self._uses_lock:
                self._uses_left[ep] -= 1
                last = self._uses_left[ep] == 0
            if last:
                self._on_release(ep)
                self.cache.release(ep)
                with self._cond:
                    # The future holds the payload as its result: drop it, or nothing is freed.
                    self._futures.pop(ep, None)

    def __iter__(self) -> Iterator[Any]:
        fetch_pool = ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="lerobot-fetch")
        decode_pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="lerobot-decode")
        admit = threading.Thread(target=self._admit_loop, args=(fetch_pool,), name="lerobot-admit", daemon=True)
        admit.start()
        window: deque[Future] = deque()
        padding_from = self.plan.real_steps
        try:
            for step in range(self.start, len(self.plan)):
                with self._cond:
                    self._progress = step
                    self._cond.notify_all()
                fut = self._future_of(int(self.plan.episodes[step]))
                window.append(decode_pool.submit(self._run_step, step, fut))
                if len(window) >= self.queue_size:
                    yield self._pop(window, step - len(window) + 1 >= padding_from)
            while window:
                yield self._pop(window, len(self.plan) - len(window) >= padding_from)
        finally:
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            for f in window:
                f.cancel()
            decode_pool.shutdown(wait=True, cancel_futures=True)
            fetch_pool.shutdown(wait=False, cancel_futures=True)
            admit.join(timeout=5)

    def _pop(self, window: deque[Future], is_padding: bool) -> Any:
        refill = self.counters.refill
        if len(refill) <= self.queue_size:
            refill.extend([0] * (self.queue_size + 1 - len(refill)))
        refill[sum(1 for f in window if f.done())] += 1
        t0 = time.perf_counter()
        item = window.popleft().result()
        self.counters.wait_seconds += time.perf_counter() - t0
        self.counters.samples += 1
        if is_padding:
            self.counters.padding_samples += 1
        return item
