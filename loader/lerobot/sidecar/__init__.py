"""MP4 sidecars: schema-v3 NPZ indexes of a LeRobot v3 dataset's videos (in LeRobot's own
layout, so either side reads the other's), and their compact, memory-mapped form used at
training time.

``build_sidecar`` indexes the MP4 files from their boxes; ``read_sidecar``/``validate_sidecar``
read and check one; ``ensure_sidecar`` finds, installs or builds one under a process lock;
``CompactIndex.open`` maps the arrays a rank needs from ``$HF_LEROBOT_HOME/streaming-indexes``.
"""

from .build import build_sidecar, needed_video_files
from .compact import (
    COMPACT_GENERATION,
    CompactArrays,
    CompactIndex,
    CompactReport,
    compact_report,
    print_compact_report,
)
from .ensure import ensure_sidecar, sidecar_cache_path
from .errors import (
    CompactIndexError,
    SidecarBuildError,
    SidecarError,
    SidecarLockTimeout,
    SidecarSchemaError,
)
from .manifest import fingerprints_match
from .process_lock import DEFAULT_LOCK_TIMEOUT_S, LOCK_TIMEOUT_SETTING
from .schema import (
    ARRAY_NAMES,
    LAYOUT_LEGACY,
    LAYOUT_LEROBOT,
    SIDECAR_SCHEMA_VERSION,
    Sidecar,
    SidecarFile,
    SidecarManifest,
    public_root,
    read_sidecar,
    sidecar_digest,
    write_sidecar,
)
from .validate import validate_sidecar

__all__ = [
    "ARRAY_NAMES",
    "COMPACT_GENERATION",
    "DEFAULT_LOCK_TIMEOUT_S",
    "LAYOUT_LEGACY",
    "LAYOUT_LEROBOT",
    "LOCK_TIMEOUT_SETTING",
    "SIDECAR_SCHEMA_VERSION",
    "CompactArrays",
    "CompactIndex",
    "CompactIndexError",
    "CompactReport",
    "Sidecar",
    "SidecarBuildError",
    "SidecarError",
    "SidecarFile",
    "SidecarLockTimeout",
    "SidecarManifest",
    "SidecarSchemaError",
    "build_sidecar",
    "compact_report",
    "ensure_sidecar",
    "fingerprints_match",
    "needed_video_files",
    "print_compact_report",
    "public_root",
    "read_sidecar",
    "sidecar_cache_path",
    "sidecar_digest",
    "validate_sidecar",
    "write_sidecar",
]
