"""Named stream errors. Messages name the URL (credentials stripped) and the byte offset."""

from __future__ import annotations


class StreamError(OSError):
    """A byte stream could not deliver the bytes it was asked for."""


class ObjectChangedError(StreamError):
    """The object's identity (ETag or size) changed between two opens of one stream."""


class RetryBudgetExceeded(StreamError):
    """A stream failed more often than ``StreamConfig.max_retries`` allows."""

    def __init__(self, url: str, offset: int, retries: int, last_error: BaseException | None):
        self.url = url
        self.offset = offset
        self.retries = retries
        self.last_error = last_error
        detail = f"{type(last_error).__name__}: {last_error}" if last_error else "unknown"
        super().__init__(
            f"{url}: gave up at byte offset {offset} after {retries} retries; last error: {detail}. "
            "Check the server or network, or raise StreamConfig.max_retries."
        )

    def __reduce__(self):  # keep it picklable across DataLoader worker boundaries
        return (type(self), (self.url, self.offset, self.retries, self.last_error))


class TransientError(StreamError):
    """A failure worth a reopen at the current offset (reset, timeout, 5xx, short body).

    Sources raise it; ``RetryingStream`` catches it. Callers only ever see it inside
    ``RetryBudgetExceeded.last_error``.
    """


# -- object stores (loader/io/objects.py) --------------------------------------------------------

class StorageError(OSError):
    """A storage request failed for a reason a person must fix (endpoint, bucket, credentials),
    or one the server gave no better name for. The message names the URL and what to check."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket a URL names does not exist at the endpoint (so nothing below it does either)."""


class AccessDeniedError(StorageError, PermissionError):
    """The server refused the request (HTTP 401/403: credentials, or what this identity may do)."""


class ObjectNotFoundError(FileNotFoundError):
    """No object at a URL (a key, or a local file). ``url`` is the location asked for."""

    def __init__(self, url: str, what: str | None = None):
        self.url = url
        self.what = what
        super().__init__(f"{what or 'reading ' + url}: no object at {url}")

    def __reduce__(self):
        return (type(self), (self.url, self.what))


class PreconditionFailedError(OSError):
    """A conditional request was refused: the object exists (``If-None-Match: *``), or is not the
    one with the ETag given (``If-Match``; also when it is gone)."""


class UnsupportedRequestError(StorageError):
    """The server does not implement what was asked (HTTP 501: a conditional header some
    S3-compatible servers lack); the caller may fall back to another way."""
