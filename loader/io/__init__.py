"""Byte streams for local paths, file://, s3://, http(s):// and hf:// URLs, and object stores.

``open_url`` is the entry point for reads; remote objects are read through ``RetryingStream``,
which reopens at the exact byte offset after a failed, short, stalled or too slow read.
``loader.io.objects`` writes (and reads whole objects), ``loader.io.urls`` says what a location
string is. Names are imported on first use: ``loader.io.urls`` alone does not pull in the HTTP
stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "HfPath": ".source_hf",
    "ObjectChangedError": ".errors",
    "RetryBudgetExceeded": ".errors",
    "RetryingStream": ".retrying",
    "StreamConfig": ".config",
    "StreamError": ".errors",
    "StreamStats": ".config",
    "open_url": ".opener",
    "parse_hf_url": ".source_hf",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'loader.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
