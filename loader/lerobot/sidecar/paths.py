"""Where sidecars and compact indexes are cached (``$HF_LEROBOT_HOME``, as LeRobot uses it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import quote

DEFAULT_HOME = "~/.cache/huggingface/lerobot"
INDEX_DIR = "streaming-indexes"     # compact memory-mapped indexes (compact.py)
SIDECAR_DIR = "mp4-sidecars"        # revision-keyed local sidecars (ensure.py)


def lerobot_home() -> Path:
    """``$HF_LEROBOT_HOME``, else ``~/.cache/huggingface/lerobot``; read at call time."""
    return Path(os.environ.get("HF_LEROBOT_HOME") or DEFAULT_HOME).expanduser()


def default_index_root() -> Path:
    return lerobot_home() / INDEX_DIR


def default_sidecar_root() -> Path:
    return lerobot_home() / SIDECAR_DIR


def safe_component(text: str) -> str:
    """``text`` as one path component: reversible %-quoting, never '', '.' or '..'."""
    q = quote(text, safe="-_.@+=")
    return q if q not in ("", ".", "..") else "%" + hashlib.sha256(text.encode()).hexdigest()[:16]
