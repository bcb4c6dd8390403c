"""Synchronized twin-tar streaming: discovery, expansion, shard lists, resume, pipeline.

The PiD pipeline's names stay importable from here (``from loader.wds import TarSample``):
``TarSample`` and ``Wdinfo`` (``shard_table``), ``ShardlistBasic`` and
``ShardlistBasicParallelSync`` (``shardlists``). Loaded on first use, so importing one
module of the package does not import them all.
"""

from importlib import import_module
from typing import Any

_SEED_NAMES = {"TarSample": "shard_table", "Wdinfo": "shard_table", "ShardlistBasic": "shardlists",
               "ShardlistBasicParallelSync": "shardlists"}

__all__ = sorted(_SEED_NAMES)


def __getattr__(name: str) -> Any:
    module = _SEED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'loader.wds' has no attribute {name!r}")
    return getattr(import_module(f"loader.wds.{module}"), name)
