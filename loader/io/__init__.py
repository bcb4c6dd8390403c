"""Byte streams for local paths, file://, s3://, http(s):// and hf:// URLs.

``open_url`` is the entry point; remote objects are read through ``RetryingStream``, which
reopens at the exact byte offset after a failed, short, stalled or too slow read.
"""

from .config import StreamConfig, StreamStats
from .errors import ObjectChangedError, RetryBudgetExceeded, StreamError
from .opener import open_url
from .retrying import RetryingStream
from .source_hf import HfPath, parse_hf_url

__all__ = [
    "HfPath",
    "ObjectChangedError",
    "RetryBudgetExceeded",
    "RetryingStream",
    "StreamConfig",
    "StreamError",
    "StreamStats",
    "open_url",
    "parse_hf_url",
]
