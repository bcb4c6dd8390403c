"""Named loader errors: each says which file, which key, and what to do."""


class LoaderError(RuntimeError):
    pass


class ManifestError(LoaderError):
    """A manifest cannot be found or used as asked (missing modality, no match...)."""


class TwinMismatchError(LoaderError):
    """Zip mode found two modality tars of one shard that disagree on a key or a length."""


class MissingKeyError(LoaderError):
    """Index mode: a key of the index is missing from a modality tar (missing_key_policy='error')."""


class ShardReadError(LoaderError):
    """A tar could not be read to the end (truncated, corrupt)."""


class DecodeError(LoaderError):
    """A member's bytes could not be decoded (corrupt image, bad JSON...); names sample and member."""


class UnsafeDataError(LoaderError):
    """Decoding would run pickle; refused unless trusted_data=True."""


class ResumeStateError(LoaderError):
    """A resume state does not belong to this dataset or is malformed."""


class EpochEndedEarlyError(LoaderError):
    """A finite epoch's readers stopped before handing out every batch this rank's plan holds."""


class CountMismatchError(ShardReadError):
    """A tar holds fewer or more samples than its manifest counts (a skip under shard_error_policy='skip')."""


class ChecksumError(ShardReadError):
    """verify='sha256': a tar's bytes do not hash to the checksum its manifest lists."""
