"""Named sidecar exceptions; each message says which file and what to do."""

from __future__ import annotations

from loader.formats.errors import FormatError


class SidecarError(FormatError):
    """A sidecar file is missing, unreadable or does not follow MP4 sidecar schema v3."""


class SidecarSchemaError(SidecarError):
    """The sidecar was written with another schema version (older sidecars are rebuilt)."""


class SidecarBuildError(RuntimeError):
    """Indexing one of the dataset's MP4 files failed; the previous sidecar is left in place."""


class SidecarLockTimeout(TimeoutError):
    """Another process held the sidecar build lock for longer than the configured timeout."""


class CompactIndexError(SidecarError):
    """A compact index file is damaged or does not belong to the sidecar it is opened for."""
