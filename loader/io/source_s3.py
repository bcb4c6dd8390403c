"""``s3://bucket/key`` byte ranges from any S3-compatible endpoint.

Each range is a GET of a URL presigned for it (with the client's credentials of the moment) over
urllib3, the library botocore itself sends with: measured, botocore's ``get_object`` costs about
1.4 ms of CPU per request (event hooks, endpoint rules, response parsing), a presign and a plain
GET about 0.7 ms. A read-ahead sends hundreds of ranged GETs per GB; with 2 DataLoader workers on
2 cores that was 18% of samples/s (bench_remote_read, 3,000 samples, 20 ms first byte). The
presign itself is most of what is left (1.1 ms of CPU, botocore's signer in Python), and a
presigned GET URL signs the host only, not the Range: an object's URL serves all of its ranges
for a minute (``_REUSE_S``), one presign per object instead of one per range. An answer
other than bytes, 412, 416 or a retryable status is asked again through ``get_object``, whose
error codes (NoSuchKey, NoSuchBucket, AccessDenied, an expired token) name the cause. Where that
call then works (a bucket in another region than the signature named, which botocore follows and
a presigned URL cannot; a policy refusing query-string signatures), the process reads that
bucket through ``get_object`` from then on.
"""

from __future__ import annotations

import errno
import http.client
import time
from typing import Any

from urllib3.exceptions import HTTPError

from .config import StreamConfig
from .errors import ObjectChangedError, StreamError, TransientError
from .s3_client import S3Settings, s3_client
from .source import Opened, parse_content_range, range_header
from .source_http import HttpSource

_RETRYABLE_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed",
})
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_PRESIGNED_FOR_S = 300  # how long a presigned URL is valid
# How long one is reused for this object's next ranges: each GET it starts has at least 4 minutes
# of validity left, and botocore refreshes expiring credentials 10-15 minutes ahead, so the
# credentials it was signed with outlive it too.
_REUSE_S = 60.0
_REUSE_MAX = 4096  # objects whose URLs are kept (a cache, dropped whole when full)
# (client, bucket, key) -> (URL, monotonic time signed, whether it goes through a proxy). The
# client is in the key: new settings, credentials or proxy variables in the environment make a
# new client (s3_client), and with it new signatures and a new look at the proxy variables
# (``proxied`` reads the whole environment: 60 us, once per object instead of once per range).
_signed: dict[tuple[Any, str, str], tuple[str, float, bool]] = {}
# (endpoint, bucket) whose presigned GETs failed where get_object then worked: read through the API.
_API_ONLY: set[tuple[str | None, str]] = set()


def s3_endpoint(config: StreamConfig) -> str | None:
    return S3Settings.for_stream(config).endpoint()


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
        where = (s3_endpoint(self._config), self._bucket)
        fresh = False
        while where not in _API_ONLY:
            url, reused = self._presigned(fresh)
            if url is None:
                break
            try:
                return HttpSource(url, self._config, display_url=self.url, send_if_match=True).open(start, end, if_match)
            except (ObjectChangedError, TransientError):
                raise
            except (FileNotFoundError, PermissionError, StreamError):
                if reused:  # signed a while ago and refused now: sign anew before judging the bucket
                    fresh = True
                    continue
                # Asked again through the API: its error code says why (and it re-signs). If it
                # works, the presigned GET cannot reach this bucket: the API from now on.
                opened = self._get_object(start, end, if_match)
                _API_ONLY.add(where)
                return opened
        return self._get_object(start, end, if_match)

    def _presigned(self, fresh: bool = False) -> tuple[str | None, bool]:
        """(this object's GET URL, whether it was signed before this call): the one signed in the
        last ``_REUSE_S`` seconds unless ``fresh``, else signed now. The URL is None when it
        cannot be signed (the API call then says why) or when the endpoint is reached through an
        HTTP(S) proxy (``proxied``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = s3_client(self._config)
        key = (client, self._bucket, self._key)
        now = time.monotonic()
        kept = None if fresh else _signed.get(key)
        if kept is not None and now - kept[1] < _REUSE_S:
            url, _, through_proxy = kept
            reused = True
        else:
            try:
                url = client.generate_presigned_url(
                    "get_object", Params={"Bucket": self._bucket, "Key": self._key}, ExpiresIn=_PRESIGNED_FOR_S)
            except (BotoCoreError, ClientError):
                return None, False
            if len(_signed) >= _REUSE_MAX:
                _signed.clear()
            through_proxy = proxied(url)
            _signed[key], reused = (url, now, through_proxy), False
        return (None if through_proxy else url), reused

    def _get_object(self, start: int, end: int | None, if_match: str | None) -> Opened | None:
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


def proxied(url: str) -> bool:
    """Whether the environment sends requests for ``url`` through a proxy (``HTTPS_PROXY``,
    ``HTTP_PROXY``, less ``NO_PROXY``): botocore goes through it, our urllib3 pool does not, so
    such a bucket is read through the API."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(url)
    return parts.scheme in getproxies() and not proxy_bypass(parts.hostname or "")
