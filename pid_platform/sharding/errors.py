"""Build errors: each names the file or folder, and the fix."""

from loader.formats.twin_tar import SourceChangedError


class BuildError(RuntimeError):
    """Base class of errors that stop a build."""


class SourceNotFoundError(BuildError):
    pass


class NoModalitiesError(BuildError):
    pass


class NoSamplesError(BuildError):
    """Intake kept no sample; building would replace good output with nothing."""


class UnsafeInputError(BuildError):
    """A file would need pickle to load (refused unless the trusted-data flag is set)."""


class OutputNotWritableError(BuildError):
    pass


class ForeignOutputError(OutputNotWritableError):
    """The output folder holds files but no mark of a previous build: it is someone else's."""


class ShardingConfigError(BuildError, ValueError):
    """A sharding setting is out of range (the message names the field)."""


class PlannedFileChangedError(BuildError, SourceChangedError):
    """A source file is not the one the plan fingerprinted (rewritten, replaced or gone since),
    or the plan names a file outside its source: the plan is stale or was tampered with. A
    ``SourceChangedError`` too, as a size that changed while a tar was written is."""
