"""Objects in an S3 bucket (AWS S3 or an S3-compatible server: MinIO, Ceph, R2), through boto3.

``s3://bucket/prefix``: object ``name`` is the key ``prefix/name``. Credentials come from boto3's
standard chain; the endpoint from ``endpoint_url=``, else ``AWS_ENDPOINT_URL``, else AWS. The
bucket must exist: a typo in a URI should fail, not create a bucket.

Create-only writes. Every PutObject and CompleteMultipartUpload this backend sends carries
``If-None-Match: *``, so an existing key is never replaced and the server answers 412
PreconditionFailed instead. Names are content-addressed (manifests are compared by their
caller), so 412 means "already there": ``put_if_absent`` returns False. A reply lost after the
write landed, followed by botocore's retry, also ends in 412 for this call's own write; it
then reports False too, with the object in place either way. Concurrent conditional writes of
one key can get 409 ConditionalRequestConflict, which botocore's retry modes do not retry:
retried here with backoff until the key exists (412) or the write wins.

Large objects go through boto3's transfer manager in parts. s3transfer (0.19) does not accept
IfNoneMatch among its upload arguments, so a ``before-parameter-build`` hook adds it to the
CompleteMultipartUpload request, the moment a multipart object appears, atomically; AWS and
moto evaluate it there. A server that ignores the header there (older MinIO or Ceph) lets a
concurrent upload of the same key complete twice: for a content-addressed blob that rewrites
the same bytes, for a manifest (small, never multipart in practice) it would be a lost race.
A HEAD before a multipart upload skips uploading the parts of an object that already exists;
it is an optimisation only (two writers can both see no object and both upload parts: the
create-only completion decides). Parts of an upload that never completes are not objects and
are never listed; a bucket lifecycle rule (AbortIncompleteMultipartUpload) reclaims them.

Retries: botocore's default mode is still ``legacy``; ``standard`` is set explicitly (retries
5xx, throttling such as 503 SlowDown, timeouts and connection errors, with jittered backoff).
Connecting and each read of a reply time out after ``s3_timeout`` seconds (``CKPTSTORE_S3_TIMEOUT``,
8), not botocore's 60, so a silent endpoint fails a call within a minute, retries included.
Errors come out as ckptstore errors: a missing bucket or key is NotFoundError; 403 and bad or
missing credentials a permanent StorageError; what survives the retries a transient one.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
)

from .. import remote_knobs
from ..errors import BadInputError, CkptStoreError, NotFoundError, StorageError, redact
from . import Data, DataReader, FileRange, ObjectInfo, ObjectStore, check_name, data_size, joined
from .retry import retry
from .s3_client import create_only, new_client, parse_s3_uri
from .s3_errors import STREAM_ERRORS, error_code, is_conflict, is_missing, is_precondition_failed, translate

T = TypeVar("T")

# CopyObject copies at most 5 GiB in one request; larger objects are copied in parts.
_COPY_LIMIT = 5 * 1024**3


class S3ObjectStore(ObjectStore):
    """An ObjectStore over a key prefix of an existing S3 bucket."""

    def __init__(
        self,
        uri: str,
        *,
        create: bool = True,
        endpoint_url: str | None = None,
        check: bool = True,
        timeout: float | None = None,
    ) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.timeout = remote_knobs.s3_timeout(timeout)
        self.client = new_client(endpoint_url, self.timeout)
        # What boto3 resolved (endpoint_url=, AWS_ENDPOINT_URL, or AWS for the region).
        self.endpoint: str = self.client.meta.endpoint_url
        for operation in ("PutObject", "CompleteMultipartUpload"):
            self.client.meta.events.register(f"before-parameter-build.s3.{operation}", create_only)
        self._endpoint_url = endpoint_url
        self._copier = None
        self._copier_lock = threading.Lock()
        self.transfer_config = TransferConfig(
            multipart_threshold=remote_knobs.s3_multipart_threshold(),
            multipart_chunksize=remote_knobs.s3_part_size(),
            max_concurrency=remote_knobs.s3_part_threads(),
            preferred_transfer_client="classic",  # the hook above lives on this client
        )
        if check:  # False: a local tier opens while S3 cannot be reached, and checks later
            self._open(create)

    def _open(self, create: bool) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code, status = error_code(exc)
            if status == 404 or code == "NoSuchBucket":
                raise NotFoundError(
                    f"bucket {self.bucket} does not exist at {redact(self.endpoint)} "
                    "(ckptstore never creates buckets: create it first)"
                ) from None
            raise self._error("open", "", exc) from None
        except BotoCoreError as exc:
            raise self._error("open", "", exc) from None
        if not create and not self._call("open", "", self._any_object):
            raise NotFoundError(f"no store at {self.uri}")

    def _any_object(self) -> bool:
        return self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)["KeyCount"] > 0

    def _error(self, action: str, name: str, exc: Exception) -> CkptStoreError:
        return translate(
            exc, action=action, name=name, uri=self.uri, bucket=self.bucket, endpoint=self.endpoint
        )

    def _call(self, action: str, name: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            raise self._error(action, name, exc) from None

    def _key(self, name: str) -> str:
        return self.prefix + check_name(name)

    # -- writing ---------------------------------------------------------------------------

    def put_if_absent(self, name: str, data: Data, *, single_request: bool = False) -> bool:
        key = self._key(name)
        size = data_size(data)
        # Parts spilled to a file, and mapped objects (a tier's upload), are streamed (a part at
        # a time for a multipart upload), never copied into one buffer: a commit or an upload
        # holds a few parts in memory, not whole packs.
        spilled = isinstance(data, memoryview) or (
            isinstance(data, list) and any(isinstance(part, FileRange) for part in data)
        )
        if not spilled:
            data = joined(data)
        if size >= remote_knobs.s3_multipart_threshold() and not single_request:
            if self.touch(name) is not None:  # there already (and now freshened)
                return False

            def put() -> None:
                # A fresh reader per attempt: a failed attempt may have consumed the last one.
                source = DataReader(data) if spilled else io.BytesIO(data)
                self.client.upload_fileobj(source, self.bucket, key, Config=self.transfer_config)
        else:
            body = None if spilled else bytes(data)

            def put() -> None:
                source = DataReader(data) if spilled else body
                self.client.put_object(Bucket=self.bucket, Key=key, Body=source, IfNoneMatch="*")

        created = self._put_create_only(name, put)
        if not created:
            self.touch(name)
        return created

    def _put_create_only(self, name: str, put: Callable[[], None]) -> bool:
        try:
            retry(put, attempts=remote_knobs.s3_max_attempts(), should_retry=is_conflict)
            return True
        except ClientError as exc:
            if is_precondition_failed(exc):
                return False
            raise self._error("write", name, exc) from None
        except BotoCoreError as exc:
            raise self._error("write", name, exc) from None

    def touch(self, name: str) -> int | None:
        # S3 has no utime: an object's LastModified changes only when it is written. Copying an
        # object onto itself with new metadata (MetadataDirective=REPLACE; S3 refuses a self-copy
        # that changes nothing) rewrites it server-side with a fresh LastModified, which is the
        # time gc's grace period reads, so no second place to look up freshness is needed. The
        # copy costs a server-side rewrite, so objects freshened recently enough are left alone.
        key = self._key(name)
        head = self._head(name, key)
        if head is None:
            return None
        size = head["ContentLength"]
        if time.time() - head["LastModified"].timestamp() < remote_knobs.s3_freshen_after():
            return size
        stamp = {"ckptstore-freshened": f"{time.time():.3f}"}
        try:
            if size <= _COPY_LIMIT:
                self.client.copy_object(
                    Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": key},
                    MetadataDirective="REPLACE", Metadata=stamp,
                )  # fmt: skip
            else:
                self._big_copier().copy(
                    {"Bucket": self.bucket, "Key": key}, self.bucket, key,
                    ExtraArgs={"MetadataDirective": "REPLACE", "Metadata": stamp},
                    Config=self.transfer_config,
                )  # fmt: skip
        except (ClientError, BotoCoreError) as exc:
            if is_missing(exc):
                return None  # deleted (by gc) since the HEAD: the caller writes it again
            raise self._error("freshen", name, exc) from None
        return size

    def _big_copier(self):
        # A multipart copy completes with CompleteMultipartUpload, which the create-only hook
        # would make fail (the key exists): it needs a client without that hook.
        with self._copier_lock:
            if self._copier is None:
                self._copier = new_client(self._endpoint_url, self.timeout)
            return self._copier

    def delete(self, name: str) -> None:
        key = self._key(name)
        self._call("delete", name, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def delete_many(self, names: list[str]) -> None:
        if not names:
            return
        if len(names) > self.delete_batch:
            raise BadInputError(f"delete_many takes at most {self.delete_batch} names, not {len(names)}")
        objects = [{"Key": self._key(name)} for name in names]
        response = self._call(
            "delete", names[0],
            lambda: self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}),
        )  # fmt: skip
        # A batch answers 200 with per-key errors; a missing key is not one of them.
        for error in response.get("Errors", []):
            name = error.get("Key", "")[len(self.prefix) :]
            raise StorageError(
                f"cannot delete {self.uri}/{name}: {error.get('Code')} ({error.get('Message')})"
            )

    # -- reading ---------------------------------------------------------------------------

    def _head(self, name: str, key: str) -> dict | None:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            if is_missing(exc):
                return None
            raise self._error("read", name, exc) from None

    def info(self, name: str) -> ObjectInfo:
        head = self._head(name, self._key(name))
        if head is None:
            raise NotFoundError(f"object {name} is missing from {self.uri}")
        return ObjectInfo(name, head["ContentLength"], head["LastModified"].timestamp())

    def get(self, name: str) -> bytes:
        # The first request asks for up to multipart_threshold bytes: smaller objects (nearly
        # all) arrive in one GET; the reply's Content-Range gives the size of larger ones,
        # whose remaining ranges are then fetched in parallel, pinned to the same ETag.
        key = self._key(name)
        threshold = remote_knobs.s3_multipart_threshold()
        try:
            first, total, etag = self._get_range(key, 0, threshold)
        except ClientError as exc:
            if error_code(exc)[0] != "InvalidRange":
                raise self._error("read", name, exc) from None
            # An empty object has no byte 0 to ask for.
            first, total, etag = self._call("read", name, lambda: self._get_range(key, None, None))
        except BotoCoreError as exc:
            raise self._error("read", name, exc) from None
        if total <= len(first):
            return first
        buffer = bytearray(total)
        buffer[: len(first)] = first
        part = max(1, remote_knobs.s3_part_size())
        starts = range(len(first), total, part)

        def fetch(start: int) -> None:
            data, _, _ = self._get_range(key, start, min(part, total - start), etag)
            buffer[start : start + len(data)] = data

        with ThreadPoolExecutor(min(len(starts), remote_knobs.s3_part_threads())) as pool:
            self._call("read", name, lambda: list(pool.map(fetch, starts)))
        return bytes(buffer)

    def get_range(self, name: str, start: int, length: int) -> bytes:
        key = self._key(name)
        if length <= 0:
            self.info(name)  # NotFoundError for a missing object, as a read of bytes would
            return b""
        try:
            data, _, _ = self._get_range(key, start, length)
        except ClientError as exc:
            if error_code(exc)[0] != "InvalidRange":
                raise self._error("read", name, exc) from None
            return b""  # the range starts past the end
        except BotoCoreError as exc:
            raise self._error("read", name, exc) from None
        return data

    def _get_range(
        self, key: str, start: int | None, length: int | None, etag: str | None = None
    ) -> tuple[bytes, int, str]:
        """``(bytes, object size, ETag)`` of ``length`` bytes from ``start`` (the whole object for None)."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if start is not None and length is not None:
            args["Range"] = f"bytes={start}-{start + length - 1}"
        if etag is not None:
            args["IfMatch"] = etag
        reading = False

        def request() -> tuple[dict, bytes]:
            nonlocal reading
            reading = False
            response = self.client.get_object(**args)
            reading = True
            return response, response["Body"].read()

        # botocore retried the request, not the body that broke off afterwards: only a failed
        # read is retried here (a request that failed has used up botocore's attempts already).
        response, data = retry(
            request,
            attempts=remote_knobs.s3_max_attempts(),
            should_retry=lambda exc: reading and isinstance(exc, STREAM_ERRORS),
        )
        content_range = response.get("ContentRange")
        # "bytes 0-99/12345"; absent when the server sent the whole object.
        total = int(content_range.rsplit("/", 1)[1]) if content_range else len(data)
        return data, total, response["ETag"]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix.startswith("/"):
            raise BadInputError(f"invalid object name prefix {prefix!r}")
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(self.prefix) :]
                    if not name or name.endswith("/"):
                        continue  # "folder" placeholders some tools create
                    yield ObjectInfo(name, item["Size"], item["LastModified"].timestamp())
        except (ClientError, BotoCoreError) as exc:
            raise self._error("list", prefix, exc) from None

    def list_temporary(self) -> Iterator[ObjectInfo]:
        # An S3 write leaves no partial object, but a writer killed during a multipart upload
        # leaves the upload open, its parts billed until it is aborted (or a lifecycle rule
        # does). Named ``<object name>#<upload id>``; the size is not listed here (0).
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix
        )
        try:
            for page in pages:
                for upload in page.get("Uploads", []):
                    name = upload["Key"][len(self.prefix) :]
                    yield ObjectInfo(f"{name}#{upload['UploadId']}", 0, upload["Initiated"].timestamp())
        except ClientError as exc:
            # Credentials allowed to read and write objects may lack ListBucketMultipartUploads,
            # and some S3-compatible servers lack the call: there is then nothing to report.
            if error_code(exc)[0] in ("AccessDenied", "NotImplemented", "MethodNotAllowed"):
                return
            raise self._error("list unfinished uploads of", self.prefix or "/", exc) from None
        except BotoCoreError as exc:
            raise self._error("list unfinished uploads of", self.prefix or "/", exc) from None

    def delete_temporary(self, names: list[str]) -> None:
        for entry in names:
            name, _, upload_id = entry.rpartition("#")
            if not name or not upload_id:
                raise BadInputError(f"{entry!r} is not the name of an unfinished upload")
            try:
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self._key(name), UploadId=upload_id
                )
            except ClientError as exc:
                if error_code(exc)[0] != "NoSuchUpload":
                    raise self._error("abort the upload of", name, exc) from None
            except BotoCoreError as exc:
                raise self._error("abort the upload of", name, exc) from None

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.uri!r}, endpoint={redact(self.endpoint)!r})"
