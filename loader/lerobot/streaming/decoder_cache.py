"""``DecoderCache``: the open ``EpisodeVideo`` decoders of recently used (episode, camera) pairs."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING

from loader.workers import release_freed_heap

from .codec import SPARE_CONTEXTS

if TYPE_CHECKING:
    from .video import EpisodeVideo


class DecoderCache:
    """An LRU of open ``EpisodeVideo`` objects keyed by (episode_index, camera).

    Evicting, discarding or clearing closes the decoder (a ``frame`` running on it finishes
    first; later calls on it raise).
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"decoder cache capacity must be >= 1, got {capacity} "
                             "(video_decoder_cache_size)")
        self.capacity = capacity
        self._videos: OrderedDict[Hashable, EpisodeVideo] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> EpisodeVideo | None:
        with self._lock:
            video = self._videos.get(key)
            if video is not None:
                self._videos.move_to_end(key)
            return video

    def put(self, key: Hashable, video: EpisodeVideo) -> None:
        with self._lock:
            old = self._videos.pop(key, None)
            self._videos[key] = video
            evicted = [self._videos.popitem(last=False)[1] for _ in range(len(self._videos) - self.capacity)]
        if old is not None and old is not video:
            evicted.append(old)
        for v in evicted:
            v.close()
        if evicted:
            release_freed_heap()   # the closed decoders' heap back to the kernel (see there)

    def discard(self, key: Hashable) -> None:
        with self._lock:
            video = self._videos.pop(key, None)
        if video is not None:
            video.close()
            release_freed_heap()

    def clear(self) -> None:
        """Close every decoder (a reader's pass is over), and let the process's spare codec
        contexts go too: nothing decodes until the next pass, which opens a few again."""
        with self._lock:
            videos = list(self._videos.values())
            self._videos.clear()
        for v in videos:
            v.close()
        SPARE_CONTEXTS.clear()

    def __len__(self) -> int:
        return len(self._videos)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._videos

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._videos)
