"""Weighted mixtures of sources: one logical dataset, one exact order, any ranks and workers.

``from loader.mixture import Mixture, Source`` (the definition, ``definition.py``), then
``build_dataset(Mixture([...]), catalog=...)``. The order is ``order.py`` over ``schedule.py``;
``shardlist.py`` deals it as one source's order is dealt. The definition imports nothing heavy;
the rest loads on first use.
"""

from importlib import import_module
from typing import Any

from loader.mixture.definition import Mixture, MixtureError, Source, check_modalities

_LAZY = {"load_mixture": "sources", "MixtureShardlist": "shardlist", "MixtureOrder": "order", "Schedule": "schedule"}

__all__ = ["Mixture", "MixtureError", "Source", "check_modalities", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loader.mixture' has no attribute {name!r}")
    return getattr(import_module(f"loader.mixture.{module}"), name)
