"""Something an S3 output holds for the length of a ``with`` block: taken on enter, renewed by a
daemon thread, let go on exit (the publish and delete claims, the build lease).

A let-go that fails is raised only when the block itself succeeded: what is left behind expires
on its own, and the block's own error is the one worth reading.
"""

from __future__ import annotations

import threading
from typing import Any, Self


class HeldInBackground:
    """Subclasses say how to take it (``_take``), renew it once (``_renew_once``; False stops the
    renewals), how often (``_renew_every_s``) and how to let it go (``_let_go``)."""

    _thread_name = "renewal"
    _stop: threading.Event | None = None
    _thread: threading.Thread | None = None

    def _take(self) -> None:
        raise NotImplementedError

    def _renew_once(self) -> bool:
        raise NotImplementedError

    def _renew_every_s(self) -> float:
        raise NotImplementedError

    def _let_go(self) -> None:
        raise NotImplementedError

    def _renewals(self, stop: threading.Event) -> None:
        while not stop.wait(self._renew_every_s()):
            if not self._renew_once():
                return

    def __enter__(self) -> Self:
        self._take()
        self._stop = stop = threading.Event()
        self._thread = threading.Thread(target=self._renewals, args=(stop,), name=self._thread_name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._let_go()
        except Exception:  # noqa: BLE001 - what is left behind only lasts until it expires
            if exc[0] is None:
                raise
