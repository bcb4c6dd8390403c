"""sha256 of each staged tar, computed once and kept beside it in the build state.

The writer hashes a tar right after writing it (its bytes still in the page cache, on the
writer's own thread, while another thread copies the next shard); the manifests step then
reads the digests back instead of hashing every tar again as one more pass over all bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loader.formats.twin_tar import file_sha256, tar_path
from pid_platform.sharding.layout import sha_cache_path, write_staged_state
from pid_platform.sharding.plan.shard_plan import ShardPlan


def tar_digests(out: Path, plan: ShardPlan) -> dict[str, str]:
    """sha256 of each of ``plan``'s tars in ``out``, hashing only those the cache does not vouch for.

    The cache is keyed by the shard plan's digest (which fixes the tar's bytes) plus the tar's
    size, inode and mtime: size and mtime alone can repeat when a rewrite lands in the same
    timestamp tick. Hashing releases the GIL, so callers run this on threads.
    """
    digest = plan.digest()
    cache_file = sha_cache_path(out, plan.bucket, plan.index)
    try:
        cache = json.loads(cache_file.read_bytes())
    except (OSError, ValueError):
        cache = {}
    digests, fresh = {}, {}
    for m in plan.modalities:
        p = tar_path(out, plan.bucket, m, plan.relpath)
        st = os.stat(p)
        ident = f"{digest}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}"
        hit = cache.get(m) if isinstance(cache, dict) else None
        if hit and hit[0] == ident:
            digests[m] = hit[1]
        else:
            digests[m] = file_sha256(p)
        fresh[m] = [ident, digests[m]]
    if fresh != cache:
        write_staged_state(cache_file, json.dumps(fresh).encode())
    return digests
