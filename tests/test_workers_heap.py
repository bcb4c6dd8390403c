"""loader.workers.release_freed_heap: glibc's malloc_trim in DataLoader workers only, skipped
cleanly where the C library has no such symbol; the LeRobot decoder cache calls it when it
closes decoders."""

from __future__ import annotations

import platform

import pytest
from torch.utils.data import DataLoader, IterableDataset

import loader.workers as workers
from loader.lerobot.streaming import decoder_cache
from loader.lerobot.streaming.decoder_cache import DecoderCache

GLIBC = platform.libc_ver()[0] == "glibc"


class _Trims(IterableDataset):
    """Yields what release_freed_heap returned in the worker, and how often trim ran there."""

    def __iter__(self):
        ran = workers.release_freed_heap()
        yield ran, getattr(workers._malloc_trim, "calls", None)


def _in_worker() -> tuple:
    loader = DataLoader(_Trims(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    (got,) = list(loader)
    return got


@pytest.fixture
def fresh_lookup(monkeypatch):
    monkeypatch.setattr(workers, "_malloc_trim", None)
    monkeypatch.setattr(workers, "_malloc_trim_looked_up", False)


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_glibc_trim_runs_in_a_worker_and_not_in_the_main_process(fresh_lookup) -> None:
    assert workers.release_freed_heap() is False          # the user's process: left alone
    assert workers._malloc_trim_looked_up is False         # not even looked up there
    ran, _ = _in_worker()
    assert ran is True
    assert workers._find_malloc_trim() is not None


def test_a_c_library_without_malloc_trim_is_skipped_silently(fresh_lookup, monkeypatch) -> None:
    class NoTrim:   # what ctypes.CDLL(None) is on a C library without the symbol
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(workers.ctypes, "CDLL", lambda *a, **k: NoTrim())
    assert workers._find_malloc_trim() is None
    ran, _ = _in_worker()
    assert ran is False


def test_the_trim_is_called_with_zero_in_the_worker(monkeypatch) -> None:
    calls = []

    def fake_trim(pad: int) -> int:
        calls.append(pad)
        fake_trim.calls = list(calls)
        return 1

    monkeypatch.setattr(workers, "_malloc_trim", fake_trim)
    monkeypatch.setattr(workers, "_malloc_trim_looked_up", True)
    ran, worker_calls = _in_worker()
    assert ran is True and worker_calls == [0]
    assert calls == []                                     # the forked worker's, not ours


class _Video:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_the_decoder_cache_releases_heap_when_it_closes_decoders(monkeypatch) -> None:
    released = []
    monkeypatch.setattr(decoder_cache, "release_freed_heap", lambda: released.append(1) or True)
    cache = DecoderCache(1)
    a, b = _Video(), _Video()
    cache.put("a", a)
    assert released == []                                  # nothing closed yet
    cache.put("b", b)                                      # evicts a
    assert a.closed and released == [1]
    cache.discard("b")
    assert b.closed and released == [1, 1]
    cache.discard("missing")
    assert released == [1, 1]
