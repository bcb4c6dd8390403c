"""Sample ids: one int per sample of a shard list, ``shard << 32 | member``."""

from __future__ import annotations

SID_SHIFT = 32  # sample id = shard_id << 32 | member index


def make_sid(shard_id: int, member: int) -> int:
    return (shard_id << SID_SHIFT) | member


def split_sid(sid: int) -> tuple[int, int]:
    return sid >> SID_SHIFT, sid & ((1 << SID_SHIFT) - 1)
