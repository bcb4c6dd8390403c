"""``EpisodeByteCache``: the byte budget of one worker's episode payloads.

A reservation is taken, in the plan's fetch order, before an episode's first byte is fetched,
and covers its pending fetch, its finished payload and its decoding: it is released only when
the last sample that reads the episode has been assembled. So ``reserved_bytes`` never exceeds
the budget, and speculative prefetch simply waits for room. ``resident_bytes`` counts payloads
that are fully fetched (even before their first sample is asked for).
"""

from __future__ import annotations

import threading
from typing import Any


class EpisodeByteCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"byte budget must be positive, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._reserved: dict[int, int] = {}
        self._payloads: dict[int, Any] = {}
        self._resident = 0
        self._cond = threading.Condition()
        self.peak_reserved_bytes = 0

    @property
    def reserved_bytes(self) -> int:
        with self._cond:
            return sum(self._reserved.values())

    @property
    def resident_bytes(self) -> int:
        with self._cond:
            return self._resident

    def reserve(self, episode: int, nbytes: int, stop: threading.Event) -> bool:
        """Block until ``nbytes`` fit, then reserve them; False if ``stop`` was set meanwhile."""
        if nbytes > self.budget_bytes:
            raise ValueError(f"episode {episode}: {nbytes} bytes exceed the budget of {self.budget_bytes}")
        with self._cond:
            while sum(self._reserved.values()) + nbytes > self.budget_bytes:
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
            if stop.is_set():
                return False
            self._reserved[episode] = nbytes
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, sum(self._reserved.values()))
            return True

    def put(self, episode: int, payload: Any, nbytes: int) -> None:
        """Record a finished fetch of a reserved episode."""
        with self._cond:
            if episode not in self._reserved:
                raise KeyError(f"episode {episode} was fetched without a reservation")
            self._payloads[episode] = (payload, nbytes)
            self._resident += nbytes

    def release(self, episode: int) -> None:
        with self._cond:
            self._reserved.pop(episode, None)
            entry = self._payloads.pop(episode, None)
            if entry is not None:
                self._resident -= entry[1]
            self._cond.notify_all()

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {"reserved_bytes": sum(self._reserved.values()), "resident_bytes": self._resident,
                    "budget_bytes": self.budget_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                    "episodes_reserved": len(self._reserved)}
