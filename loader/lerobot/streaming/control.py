"""The epoch's setup, handed from the training process to its DataLoader workers through
shared memory: persistent workers (``persistent_workers=True``) start each epoch from it.

A worker's copy of the dataset is made once, when the worker starts; with persistent workers
it lives across epochs, so the epoch number and the plan's layout (and an exact resume point
after ``load_state_dict``) cannot travel with it. ``make_loader`` writes them here before each
epoch's first batch is asked for; a worker reads them when its iteration starts.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

_HEADER = 8   # bytes: the payload's length, int64


def control_block(num_episodes: int, world_size: int) -> torch.Tensor:
    """A shared buffer large enough for any setup of this selection: a layout's base holds at
    most one (episode, start) pair per episode, a resume point a count per rank."""
    size = _HEADER + 64 * 1024 + 48 * num_episodes + 48 * world_size
    return torch.zeros(size, dtype=torch.uint8).share_memory_()


def write_control(block: torch.Tensor, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if _HEADER + len(data) > block.numel():
        raise RuntimeError(f"the epoch setup ({len(data)} bytes) does not fit the workers' control block "
                           f"({block.numel() - _HEADER} bytes); this is a bug, please report it")
    view = block.numpy()
    view[_HEADER:_HEADER + len(data)] = memoryview(data)
    view[:_HEADER] = memoryview(len(data).to_bytes(_HEADER, "little"))


def read_control(block: torch.Tensor) -> Any:
    view = block.numpy()
    n = int.from_bytes(view[:_HEADER].tobytes(), "little")
    if not n:
        raise RuntimeError("the workers' control block is empty: iterate the loader make_loader returns, "
                           "not a DataLoader of its own over the dataset")
    return pickle.loads(view[_HEADER:_HEADER + n].tobytes())
