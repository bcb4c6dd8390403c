"""``s3://bucket/key`` byte ranges through boto3 ``get_object`` (any S3-compatible endpoint)."""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import threading
from typing import Any

from urllib3.exceptions import HTTPError

from .config import StreamConfig
from .errors import ObjectChangedError, StreamError, TransientError
from .source import Opened, parse_content_range, range_header

_RETRYABLE_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed",
})
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN",
             "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
_sessions: dict[tuple, Any] = {}
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


def s3_endpoint(config: StreamConfig) -> str | None:
    return (config.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


def s3_client(config: StreamConfig) -> Any:
    """A boto3 S3 client for this process, environment, endpoint and timeouts, made once."""
    endpoint = s3_endpoint(config)
    # Credentials are read from the environment when a session starts, so the environment is
    # part of the key; the secret goes in hashed, since a key is a place it could leak from.
    secret = hashlib.sha256(os.environ.get("AWS_SECRET_ACCESS_KEY", "").encode()).hexdigest()
    env = (os.getpid(), secret, *(os.environ.get(k) for k in _ENV_KEYS))
    key = (env, endpoint, config.connect_timeout_s, config.read_timeout_s)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            if any(k[0][0] != os.getpid() for k in _clients):  # forked: the parent's sockets are not ours
                _clients.clear()
                _sessions.clear()
            if env not in _sessions:
                import boto3

                _sessions[env] = boto3.session.Session()
            # A session is not thread-safe; the lock covers both.
            client = _clients[key] = _make_client(_sessions[env], endpoint, config)
        return client


def _make_client(session: Any, endpoint: str | None, config: StreamConfig) -> Any:
    from botocore import UNSIGNED
    from botocore.config import Config

    options: dict[str, Any] = dict(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        # botocore's own retries would replay a request from its start and hide failures from our
        # counters; RetryingStream reopens at the exact byte offset instead.
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=32,
    )
    if "response_checksum_validation" in Config.OPTION_DEFAULTS:  # botocore >= 1.36
        # Full-object checksums do not apply to ranged reads; do not ask for them.
        options["response_checksum_validation"] = "when_required"
    if endpoint:
        # Self-hosted S3 (SeaweedFS, MinIO, an IP address) rarely has wildcard DNS for buckets.
        options["s3"] = {"addressing_style": "path"}
    if session.get_credentials() is None:
        options["signature_version"] = UNSIGNED  # public buckets
    return session.client("s3", endpoint_url=endpoint, config=Config(**options))


class _BotoBody:
    def __init__(self, streaming_body: Any, url: str):
        self._body = streaming_body
        # read1 on the underlying urllib3 response returns as soon as bytes arrive, which the
        # throughput floor needs; StreamingBody.read(n) would block until all n arrived.
        raw = getattr(streaming_body, "_raw_stream", None)
        self._read1 = getattr(raw, "read1", None) or streaming_body.read
        self._url = url

    def read1(self, n: int) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return self._read1(n)
        except (HTTPError, http.client.HTTPException, OSError, BotoCoreError) as e:
            raise TransientError(f"{self._url}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._body.close()


class S3Source:
    def __init__(self, bucket: str, key: str, config: StreamConfig):
        if not bucket or not key:
            raise ValueError(f"s3 URL needs a bucket and a key: s3://{bucket}/{key}")
        self._bucket = bucket
        self._key = key
        self._config = config
        self.url = f"s3://{bucket}/{key}"

    def open(self, start: int, end: int | None, if_match: str | None) -> Opened | None:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            ParamValidationError,
        )

        params: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key, "Range": range_header(start, end)}
        if if_match:
            params["IfMatch"] = if_match
        try:
            resp = s3_client(self._config).get_object(**params)
        except ClientError as e:
            return self._client_error(e)
        except (NoCredentialsError, ParamValidationError) as e:
            raise StreamError(f"{self.url}: {e}") from None
        except (BotoCoreError, HTTPError, OSError) as e:
            raise TransientError(f"{self.url}: {type(e).__name__}: {e}") from e

        body = _BotoBody(resp["Body"], self.url)
        etag = resp.get("ETag")
        length = resp.get("ContentLength")
        cr = parse_content_range(resp.get("ContentRange"))
        if cr is not None:
            return Opened(body, cr[0], cr[1], cr[2], etag)
        if resp["ResponseMetadata"]["HTTPStatusCode"] == 206:
            return Opened(body, start, None if length is None else start + length, None, etag)
        return Opened(body, 0, length, length, etag)

    def _client_error(self, e: Any) -> None:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if status == 416 or code == "InvalidRange":
            return None  # asked for bytes at or past the end: an empty remainder
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
            raise FileNotFoundError(errno.ENOENT, f"not found ({code or status})", self.url)
        if status in (401, 403):
            raise PermissionError(errno.EACCES, f"access denied ({code or status}); check the credentials", self.url)
        if status == 412 or code == "PreconditionFailed":
            raise ObjectChangedError(f"{self.url}: the object changed while it was being read ({code or status})")
        if status in _RETRYABLE_STATUS or code in _RETRYABLE_CODES:
            raise TransientError(f"{self.url}: {code or status}")
        raise StreamError(f"{self.url}: {code or status}: {err.get('Message', '')}")
