"""The one place in the project that makes S3 clients (loader, build, publishing, Dagster).

``S3Settings`` says where and how to connect (endpoint, region, profile, timeouts, botocore's own
retries); credentials come from boto3's usual chain (environment, profile, instance role) and
never from configuration. ``s3_client(settings)`` returns a client made once per process,
environment and settings. A build that hands work to spawned processes passes
``settings.frozen_credentials()``: the credentials the chain resolved in the parent, so a worker
started before they were exported still signs as the parent does.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    UnsupportedRequestError,
)
from .urls import split_s3

if TYPE_CHECKING:
    from .config import StreamConfig

# The proxy variables too: botocore reads them when it makes a client, and source_s3.proxied
# reads them per GET; a client kept from before HTTP_PROXY was set would go around the proxy.
_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN",
             "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
             "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
_sessions: dict[tuple, Any] = {}
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()
# Clients made for processes about to be forked (DataLoader workers), never used by their maker:
# (env, settings) -> (maker's pid, client). See client_for_fork.
_spares: dict[tuple, tuple[int, Any]] = {}


@dataclass(frozen=True)
class S3Settings:
    """Where and how to reach S3; no credentials unless frozen for a worker process.

    ``max_attempts``: botocore's own attempts per request (``None``: botocore's default, or
    ``AWS_MAX_ATTEMPTS``). Byte streams use 1: ``RetryingStream`` reopens at the exact byte
    offset and counts it.
    """

    endpoint_url: str | None = None   # else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS
    region: str | None = None         # else AWS_REGION, else boto3's (AWS_DEFAULT_REGION, the profile)
    profile: str | None = None        # a named profile of the shared config files
    max_attempts: int | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    # (access key, secret key, session token) resolved in a parent process; see frozen_credentials.
    credentials: tuple[str, str, str | None] | None = field(default=None, repr=False)

    @classmethod
    def for_stream(cls, config: StreamConfig) -> S3Settings:
        # botocore's own retries would replay a request from its start and hide failures from our
        # counters; RetryingStream reopens at the exact byte offset instead.
        return cls(endpoint_url=config.s3_endpoint_url, max_attempts=1,
                   connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.read_timeout_s)

    def endpoint(self) -> str | None:
        """The endpoint a client uses: the setting, else the service variable, else the general one."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)

    def where(self) -> str:
        """The endpoint, for error messages."""
        return self.endpoint() or "the default AWS endpoint"

    def frozen_credentials(self) -> S3Settings:
        """These settings with the endpoint, region and credentials the chain resolves now."""
        if self.credentials is not None:
            return self
        session = _session(self)
        creds = session.get_credentials()
        frozen = None
        if creds is not None:
            f = creds.get_frozen_credentials()
            frozen = (f.access_key, f.secret_key, f.token)
        return replace(self, endpoint_url=self.endpoint(), region=self.region or session.region_name,
                       profile=None, credentials=frozen)


def _env_key() -> tuple:
    # Credentials are read from the environment when a session starts, so the environment is
    # part of the key; the secret goes in hashed, since a key is a place it could leak from.
    secret = hashlib.sha256(os.environ.get("AWS_SECRET_ACCESS_KEY", "").encode()).hexdigest()
    return (secret, *(os.environ.get(k) for k in _ENV_KEYS))


def _settings_key(settings: S3Settings) -> tuple:
    creds = settings.credentials
    hashed = None if creds is None else hashlib.sha256("\0".join(c or "" for c in creds).encode()).hexdigest()
    return (settings.endpoint(), settings.region, settings.profile, settings.max_attempts,
            settings.connect_timeout_s, settings.read_timeout_s, hashed)


def _session(settings: S3Settings) -> Any:
    import boto3

    # AWS_REGION is the SDKs' standard variable (and wins over AWS_DEFAULT_REGION there); boto3
    # reads only AWS_DEFAULT_REGION and the profile, so a region set the standard way was lost:
    # presigned GETs signed for us-east-1 failed against another region's bucket once each.
    region = settings.region or os.environ.get("AWS_REGION") or None
    if settings.credentials is not None:
        key_id, secret, token = settings.credentials
        return boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret,
                                     aws_session_token=token, region_name=region)
    return boto3.session.Session(profile_name=settings.profile, region_name=region)


def s3_client(settings: S3Settings | StreamConfig | None = None) -> Any:
    """A boto3 S3 client for this process, environment and settings, made once and shared
    (boto3 clients are thread-safe; sessions are not, so making one holds a lock)."""
    if settings is None:
        settings = S3Settings()
    elif not isinstance(settings, S3Settings):
        settings = S3Settings.for_stream(settings)
    env = _env_key()
    key = (os.getpid(), env, _settings_key(settings))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            if any(k[0] != os.getpid() for k in _clients):  # forked: the parent's sockets are not ours
                _clients.clear()
            spare = _spares.get(key[1:])
            if spare is not None and spare[0] != os.getpid():  # made by the parent for us, never used
                del _spares[key[1:]]  # ours now: a process forked from this one must not take it
                client = _clients[key] = spare[1]
                return client
            # A session holds no sockets, only what it loaded (the S3 service model, 0.2 s of
            # JSON): a forked DataLoader worker makes its client from the parent's in 10 ms.
            skey = (env, settings.profile, settings.region, _settings_key(settings)[-1])
            if skey not in _sessions:
                _sessions[skey] = _session(settings)
            client = _clients[key] = _make_client(_sessions[skey], settings)
        return client


def client_for_fork(settings: S3Settings | StreamConfig | None = None) -> Any:
    """Make, in this process, the client that processes forked from it next will use (a forked
    process may not use its parent's clients: their pooled sockets are the parent's). Made once
    and never used here, it holds no socket; each forked process then starts with it instead of
    making its own (instrumented: 80-130 ms of CPU in each DataLoader worker, at its start, where
    a second client made here costs 10-30 ms). Returns it (for tests: this process never uses it)."""
    if settings is None:
        settings = S3Settings()
    elif not isinstance(settings, S3Settings):
        settings = S3Settings.for_stream(settings)
    env = _env_key()
    skey = (env, _settings_key(settings))
    with _clients_lock:
        spare = _spares.get(skey)
        if spare is not None and spare[0] == os.getpid():
            return spare[1]
        sess_key = (env, settings.profile, settings.region, skey[1][-1])
        if sess_key not in _sessions:
            _sessions[sess_key] = _session(settings)
        client = _make_client(_sessions[sess_key], settings)
        _spares[skey] = (os.getpid(), client)
        return client


def _make_client(session: Any, settings: S3Settings) -> Any:
    from botocore import UNSIGNED
    from botocore.config import Config

    options: dict[str, Any] = dict(
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
        max_pool_connections=32,
    )
    if settings.max_attempts is not None:
        options["retries"] = {"mode": "standard", "total_max_attempts": settings.max_attempts}
    if "response_checksum_validation" in Config.OPTION_DEFAULTS:  # botocore >= 1.36
        # Full-object checksums do not apply to ranged reads; do not ask for them.
        options["response_checksum_validation"] = "when_required"
    endpoint = settings.endpoint()
    if endpoint:
        # Self-hosted S3 (SeaweedFS, MinIO, an IP address) rarely has wildcard DNS for buckets.
        options["s3"] = {"addressing_style": "path"}
    if session.get_credentials() is None:
        options["signature_version"] = UNSIGNED  # public buckets
    else:
        # Presigned URLs (the loader's ranged GETs, source_s3) in SigV4, as API calls already are:
        # botocore presigns S3 in SigV2 unless told, which AWS regions opened since 2014 refuse.
        options["signature_version"] = "s3v4"
    return session.client("s3", endpoint_url=endpoint, config=Config(**options))


# The project's one name for "an S3 request failed for a reason a person must fix".
S3AccessError = StorageError

_NOT_FOUND = ("NoSuchKey", "404", "NotFound")
_REFUSED = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
_PRECONDITION = ("PreconditionFailed", "ConditionalRequestConflict")


def s3_error(exc: BaseException, settings: S3Settings, what: str, bucket: str, url: str | None = None) -> OSError:
    """The one translation of boto3's exceptions into the project's errors (``loader/io/errors.py``).

    ``what`` names the request (``"writing s3://b/k"``), ``url`` the object it was about.
    A missing key becomes ``ObjectNotFoundError``, a refused condition (HTTP 412, or 409 for a
    concurrent conditional write) ``PreconditionFailedError``, a missing bucket
    ``BucketNotFoundError``, a refusal (401/403) ``AccessDeniedError``, a request the server does
    not implement (501) ``UnsupportedRequestError``; everything else a ``StorageError`` that says
    what to check. Anything
    that is not boto3's is returned as it is. Raise the result ``from exc``.
    """
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
    )

    where = settings.where()
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code, msg = str(err.get("Code", "?")), err.get("Message", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{what}: bucket {bucket!r} does not exist at {where}; create it or fix "
                                       "the s3:// URL")
        if status == 412 or (status == 409 and code in _PRECONDITION) or code in _PRECONDITION:
            return PreconditionFailedError(f"{what}: S3 at {where} refused the condition ({code}): "
                                           f"{url or 'the object'} is not in the state the request required")
        if status in (401, 403) or code in _REFUSED:
            return AccessDeniedError(
                f"{what}: S3 at {where} refused the request ({code}: {msg}); check AWS_ACCESS_KEY_ID / "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and that this identity may use s3://{bucket}")
        if status == 501 or code == "NotImplemented":
            return UnsupportedRequestError(f"{what}: S3 at {where} does not implement this request ({code}: {msg})")
        if code in _NOT_FOUND or status == 404:
            return ObjectNotFoundError(url or f"s3://{bucket}", what)
        return StorageError(f"{what}: S3 at {where} answered {code} (HTTP {status}): {msg}")
    if isinstance(exc, NoCredentialsError):
        return StorageError(f"{what}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if isinstance(exc, EndpointConnectionError):
        return StorageError(f"{what}: cannot connect to S3 at {where}; check AWS_ENDPOINT_URL (or the "
                            "endpoint setting) and that the server is up")
    if isinstance(exc, (BotoCoreError, Boto3Error)):  # Boto3Error: the transfer manager's (multipart) failures
        return StorageError(f"{what}: S3 at {where}: {exc}")
    return exc if isinstance(exc, OSError) else StorageError(f"{what}: {type(exc).__name__}: {exc}")


def is_s3_exception(exc: BaseException) -> bool:
    """Whether ``exc`` is one of boto3's (what ``s3_error`` translates)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(exc, (ClientError, BotoCoreError, Boto3Error))


@contextmanager
def s3_errors(settings: S3Settings, what: str, bucket: str) -> Iterator[None]:
    """``s3_error`` around a block of boto3 calls, for code inside ``loader/io``.

    A missing key and a refused condition come out as ``ObjectNotFoundError`` and
    ``PreconditionFailedError`` (which are not ``S3AccessError``s); everything else of boto3's as
    an ``S3AccessError`` naming what to check. The original exception is the ``__cause__``.
    """
    try:
        yield
    except Exception as e:
        if not is_s3_exception(e):
            raise
        raise s3_error(e, settings, what, bucket) from e


split_s3_url = split_s3  # the older name
