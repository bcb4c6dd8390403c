"""MP4 indexing from boxes alone: range reads of ``ftyp`` and ``moov`` (never the media data).

``index_mp4(source)`` returns an ``Mp4Index`` with per-sample presentation times, durations,
composition offsets, sizes and absolute byte offsets of the video track, plus its sync samples.
"""

from .errors import EditListError, Mp4FormatError
from .index import Mp4Index, index_mp4

__all__ = ["EditListError", "Mp4FormatError", "Mp4Index", "index_mp4"]
