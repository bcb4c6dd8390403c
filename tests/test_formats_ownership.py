"""One owner per format and per client: no module outside ``loader/formats`` parses wdinfo.json,
key indexes or tar headers; no module outside ``loader/io`` creates an S3 client, makes an S3
request or catches boto3's errors (``loader/io/objects.py`` is the storage layer), or decides by
hand whether a string is a URL (``loader/io/urls.py`` says what a location is).

A grep over the project's code (``loader``, ``pid_platform``, ``examples``; ``bench`` holds the
peers' code paths on purpose, ``tests`` build hostile inputs by hand). Each pattern names what a
second reader would have to spell: a manifest field, a key-index column, a tar-header API, a
boto3 client or session. A self-test shows each pattern catches the line it is meant for.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT_DIRS = ("loader", "pid_platform", "examples")

_Q = "[\"']"
# Reading a manifest field by name: doc["data_list"], doc.get("total_key_count"), ...
WDINFO_FIELDS = re.compile(
    rf"(\[|\.get\()\s*{_Q}(data_list|data_list_key_count|total_key_count|data_keys|tar_bytes|tar_sha256|"
    rf"key_index|chunk_size|format_version){_Q}"
)
# A key-index column spelled out: "offset.image", f"member.{m}" (the intake table has size.<m> too).
KEY_INDEX_COLUMNS = re.compile(rf"{_Q}(member|offset)\.")
# Reading tar headers: tarfile objects, webdataset's tar iterator, a header parsed from bytes
# (a slice at a USTAR field's offset: size 124, checksum 148, type 156, magic 257, prefix 345).
TAR_HEADERS = re.compile(
    r"tarfile\.(open|TarFile|TarInfo)\b|\bTarInfo\b|\btar_file_iterator\b|\btariterators\b|\bfrombuf\(|"
    r"\[\s*(124|148|156|257|345)\s*:"
)
# Every way boto3 (or dagster-aws's S3Resource) hands out a client or a session.
S3_CLIENTS = re.compile(
    r"boto3\.(client|resource|Session|session\.Session)\(|\.client\(\s*['\"]s3['\"]|"
    r"^\s*import boto3|^\s*from boto3(\.\w+)* import|\bget_client\(|\bget_s3_client\("
)

# An S3 request or boto3's errors: every read, write, listing, copy and delete goes through
# loader.io.objects, whose one translator (s3_error) turns them into the project's errors.
S3_CALLS = re.compile(
    r"\.(put_object|get_object|head_object|head_bucket|list_objects(_v2)?|list_buckets|copy_object|delete_objects?|"
    r"upload_file(obj)?|download_file(obj)?|create_multipart_upload|upload_part(_copy)?|complete_multipart_upload|"
    r"abort_multipart_upload|create_bucket|get_paginator)\(|\.copy\(\s*\{\s*[\"']Bucket[\"']|"
    r"\b(ClientError|BotoCoreError|EndpointConnectionError|NoCredentialsError)\b|^\s*(import|from) botocore"
)
# A hand-written "is this a URL" test: a scheme prefix, "://" looked for or split on, a file://
# stripped by hand, urlparse, a parsed scheme compared, or a scheme regex of one's own.
URL_TESTS = re.compile(
    r"startswith\(\s*\(?\s*[\"'][A-Za-z][A-Za-z0-9+.-]*://|[\"']://[\"']\s*(not\s+)?in\b|split\(\s*[\"']://|"
    r"removeprefix\(\s*[\"'][A-Za-z][A-Za-z0-9+.-]*://|\burlparse\(|\.scheme\s*(==|!=|in\b|not\s+in\b)|"
    r"\[A-Za-z\]\[A-Za-z0-9\+\.-\]\*\)?://"
)


def _offenders(pattern: re.Pattern, owner: str) -> list[str]:
    found = []
    for folder in PROJECT_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(owner + "/"):
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_only_loader_formats_reads_wdinfo_fields() -> None:
    offenders = _offenders(WDINFO_FIELDS, "loader/formats")
    assert offenders == [], "read manifests with loader.formats.wdinfo (check_wdinfo, read_wdinfo):\n" + "\n".join(
        offenders)


def test_only_loader_formats_spells_key_index_columns() -> None:
    offenders = _offenders(KEY_INDEX_COLUMNS, "loader/formats")
    assert offenders == [], "read key indexes with loader.formats.key_index.read_key_columns:\n" + "\n".join(
        offenders)


def test_only_loader_formats_parses_tar_headers() -> None:
    offenders = _offenders(TAR_HEADERS, "loader/formats")
    assert offenders == [], "read tars with loader.formats.twin_tar:\n" + "\n".join(offenders)


def test_only_loader_io_makes_s3_clients() -> None:
    offenders = _offenders(S3_CLIENTS, "loader/io")
    assert offenders == [], "make S3 clients in loader/io (one factory):\n" + "\n".join(offenders)


def test_only_loader_io_talks_to_s3() -> None:
    offenders = _offenders(S3_CALLS, "loader/io")
    assert offenders == [], ("read and write objects with loader.io.objects (open_store, S3Objects); its errors are "
                             "loader.io.errors':\n" + "\n".join(offenders))


def test_only_loader_io_tells_urls_from_paths() -> None:
    offenders = _offenders(URL_TESTS, "loader/io")
    assert offenders == [], "ask loader.io.urls (kind, is_s3, is_local, local_path ...):\n" + "\n".join(offenders)


@pytest.mark.parametrize(("pattern", "line"), [
    (WDINFO_FIELDS, 'counts = doc["data_list_key_count"]'),
    (WDINFO_FIELDS, "total = manifest.get('total_key_count', 0)"),
    (KEY_INDEX_COLUMNS, 'table.column(f"offset.{m}")'),
    (KEY_INDEX_COLUMNS, "idx['member.image']"),
    (TAR_HEADERS, 'with tarfile.open(path, "r:") as tf:'),
    (TAR_HEADERS, "info = tarfile.TarInfo.frombuf(block, 'utf-8', 'surrogateescape')"),
    (TAR_HEADERS, "from webdataset.tariterators import tar_file_iterator"),
    (TAR_HEADERS, 'stored_size = int(hdr[124:136].strip(b" \\0") or b"0", 8)'),
    (TAR_HEADERS, "if hdr[345:500].strip(b'\\0'):"),
    (S3_CLIENTS, 'c = boto3.client("s3")'),
    (S3_CLIENTS, "session = boto3.session.Session()"),
    (S3_CLIENTS, "import boto3"),
    (S3_CLIENTS, "client = context.resources.s3.get_client()"),
    (S3_CALLS, 'client.put_object(Bucket=b, Key=k, Body=data, IfNoneMatch="*")'),
    (S3_CALLS, "body = self.client.get_object(Bucket=self.bucket, Key=key)['Body']"),
    (S3_CALLS, 'for page in client.get_paginator("list_objects_v2").paginate(Bucket=b):'),
    (S3_CALLS, "resp = client.list_objects_v2(Bucket=b, Prefix=p)"),
    (S3_CALLS, "client.copy_object(Bucket=b, Key=k, CopySource=src)"),
    (S3_CALLS, 'client.copy({"Bucket": b, "Key": src}, b, key)'),
    (S3_CALLS, "head = client.head_object(Bucket=b, Key=k)"),
    (S3_CALLS, "client.delete_object(Bucket=b, Key=k)"),
    (S3_CALLS, "client.delete_objects(Bucket=b, Delete={'Objects': keys})"),
    (S3_CALLS, "client.upload_file(str(path), bucket, key)"),
    (S3_CALLS, "client.head_bucket(Bucket=b)"),
    (S3_CALLS, "except ClientError as exc:"),
    (S3_CALLS, "from botocore.exceptions import BotoCoreError"),
    (URL_TESTS, 'if root.startswith("s3://"):'),
    (URL_TESTS, "if url.startswith(('http://', 'https://')):"),
    (URL_TESTS, 'if "://" in location and not location.startswith("file://"):'),
    (URL_TESTS, "local = '://' not in args.root"),
    (URL_TESTS, 'scheme, rest = base.split("://", 1)'),
    (URL_TESTS, 'path = Path(text.removeprefix("file://"))'),
    (URL_TESTS, "parsed = urlparse(uri)"),
    (URL_TESTS, 'if parts.scheme != "s3" or not parts.netloc:'),
    (URL_TESTS, "if parts.scheme not in ('http', 'https'):"),
    (URL_TESTS, '_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")'),
    (URL_TESTS, '_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")'),
])
def test_each_grep_catches_what_it_is_for(pattern: re.Pattern, line: str) -> None:
    assert pattern.search(line)


@pytest.mark.parametrize(("pattern", "line"), [
    (WDINFO_FIELDS, 'sample["__bucket__"] = m["bucket"]'),
    (KEY_INDEX_COLUMNS, 'cols[f"size.{m}"] = sizes'),
    (TAR_HEADERS, "PERMANENT_ERRORS = (BuildError, ValueError, tarfile.TarError)"),
    (TAR_HEADERS, "np.frombuffer(data, dtype)"),
    (S3_CALLS, "store.put(key, body, content_type='application/json')"),
    (S3_CALLS, "out = qs.copy()"),
    (S3_CALLS, "store.copy(src_key, dst_key)"),
    (URL_TESTS, "elif fp.startswith('s3:etag='):"),
    (URL_TESTS, "return urlunsplit((parts.scheme, netloc, parts.path, '', ''))"),
    (URL_TESTS, "if urls.is_s3(root):"),
])
def test_the_greps_leave_unrelated_lines_alone(pattern: re.Pattern, line: str) -> None:
    assert not pattern.search(line)
