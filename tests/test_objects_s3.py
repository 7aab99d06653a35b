"""What only the S3 backend does: URIs, retries, conditional writes, faults and their errors.

Against the loopback moto server; faults come from botocore ``before-send`` hooks (see
tests/moto_s3.py), so every request that is not answered by a fault reaches the server.
"""

from __future__ import annotations

import time

import pytest
from botocore.exceptions import ConnectionClosedError

from ckptstore.errors import BadInputError, NotFoundError, StorageError
from ckptstore.objects import open_objects
from ckptstore.objects import s3 as s3_backend
from ckptstore.objects.s3 import S3ObjectStore, parse_s3_uri
from tests.moto_s3 import inject_faults

MIB = 1024 * 1024


@pytest.fixture
def objects(s3):
    return open_objects(s3.uri("run"))


def test_uris_name_a_bucket_and_an_optional_prefix():
    assert parse_s3_uri("s3://ckpts/llama-8b/run7") == ("ckpts", "llama-8b/run7/")
    assert parse_s3_uri("s3://ckpts/llama-8b/run7/") == ("ckpts", "llama-8b/run7/")
    assert parse_s3_uri("s3://ckpts") == ("ckpts", "")
    for bad in (
        "s3://",
        "s3://Upper/x",
        "s3://ab/x",
        "s3://ckpts/a//b",
        "s3://ckpts/../x",
        "s3://ckpts/x?v=1",
    ):
        with pytest.raises(BadInputError):
            parse_s3_uri(bad)


def test_objects_live_under_the_prefix_and_a_bare_bucket_works_too(s3):
    open_objects(s3.uri("team/run")).put_if_absent("blobs/ab/x", b"1")
    open_objects(s3.uri("")).put_if_absent("blobs/ab/y", b"2")
    assert sorted(s3.keys()) == ["blobs/ab/y", "team/run/blobs/ab/x"]
    assert [o.name for o in open_objects(s3.uri("team/run")).list()] == ["blobs/ab/x"]


def test_the_endpoint_comes_from_the_argument_or_aws_endpoint_url(s3, monkeypatch):
    assert open_objects(s3.uri()).endpoint == s3.endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    assert open_objects(s3.uri(), endpoint_url=s3.endpoint).endpoint == s3.endpoint


def test_retries_are_in_standard_mode(objects):
    assert objects.client.meta.config.retries == {"mode": "standard", "total_max_attempts": 5}


def test_a_missing_bucket_is_not_found_and_nothing_is_created(s3):
    with pytest.raises(NotFoundError, match="bucket ckpt-nosuchbucket does not exist"):
        open_objects("s3://ckpt-nosuchbucket/run")
    assert "ckpt-nosuchbucket" not in [b["Name"] for b in s3.client.list_buckets()["Buckets"]]


@pytest.mark.parametrize(
    "fault", ["connection", (500, "InternalError"), (503, "SlowDown"), (503, "ServiceUnavailable")]
)
def test_transient_faults_are_retried_until_the_request_goes_through(objects, fault):
    put = inject_faults(objects.client, "PutObject", fault)
    get = inject_faults(objects.client, "GetObject", fault)
    assert objects.put_if_absent("blobs/ab/x", b"data") is True
    assert objects.get("blobs/ab/x") == b"data"
    assert put.answered == get.answered == 1


def test_faults_that_outlast_the_retries_are_one_transient_storage_error(s3, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_MAX_ATTEMPTS", "2")
    objects = open_objects(s3.uri())
    inject_faults(objects.client, "GetObject", (503, "SlowDown"), times=None)
    objects.put_if_absent("blobs/ab/x", b"data")
    with pytest.raises(StorageError, match="SlowDown") as raised:
        objects.get("blobs/ab/x")
    assert raised.value.transient


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_403_is_one_permanent_error_that_names_the_credentials(objects, s3, code):
    faults = inject_faults(objects.client, "PutObject", (403, code), times=None)
    with pytest.raises(StorageError, match=f"access denied \\({code}.*check the AWS credentials") as raised:
        objects.put_if_absent("blobs/ab/x", b"data")
    assert not raised.value.transient
    assert len(faults.seen) == 1  # not retried
    assert s3.keys() == []


def test_missing_credentials_are_a_clear_error(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match="no AWS credentials found"):
        open_objects(s3.uri())


def test_a_bucket_deleted_under_a_store_is_not_found(objects):
    inject_faults(objects.client, "PutObject", (404, "NoSuchBucket"), times=None)
    with pytest.raises(NotFoundError, match="bucket .* does not exist"):
        objects.put_if_absent("blobs/ab/x", b"data")


def test_409_conflicts_are_retried_until_the_write_wins(objects):
    faults = inject_faults(objects.client, "PutObject", (409, "ConditionalRequestConflict"), times=2)
    assert objects.put_if_absent("blobs/ab/x", b"data") is True
    assert faults.answered == 2
    assert objects.get("blobs/ab/x") == b"data"


def test_a_retry_after_a_lost_reply_finds_its_own_write_and_reports_it_there(objects, s3):
    # The first PutObject reaches the server, but the reply never comes back; botocore's retry
    # then meets If-None-Match and gets 412.
    lost = []

    def write_then_drop(request, **_):
        if not lost:
            lost.append(request.url)
            s3.client.put_object(Bucket=s3.bucket, Key="run/blobs/ab/x", Body=b"data")
            raise ConnectionClosedError(endpoint_url=request.url)

    objects.client.meta.events.register("before-send.s3.PutObject", write_then_drop)
    assert objects.put_if_absent("blobs/ab/x", b"data") is False
    assert objects.get("blobs/ab/x") == b"data" and lost


def test_large_objects_complete_their_multipart_upload_with_if_none_match(s3, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_MULTIPART_THRESHOLD", str(MIB))
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(5 * MIB))
    objects = open_objects(s3.uri())
    headers = {}

    def record(request, **kwargs):
        headers.setdefault(kwargs["event_name"].rsplit(".", 1)[-1], []).append(request.headers)

    objects.client.meta.events.register("before-send.s3", record)
    data = b"\x01" * (7 * MIB)
    assert objects.put_if_absent("blobs/ab/big", data) is True
    assert len(headers["UploadPart"]) == 2
    assert headers["CompleteMultipartUpload"][0]["If-None-Match"] == b"*"
    assert s3.client.head_object(Bucket=s3.bucket, Key="run/blobs/ab/big")["ETag"].endswith('-2"')
    # Racing an upload of the same key that completes first: the completion is refused (412).
    completed_first = []

    def race(request, **_):
        if not completed_first:
            completed_first.append(True)
            s3.client.put_object(Bucket=s3.bucket, Key="run/blobs/cd/big", Body=data)

    objects.client.meta.events.register("before-send.s3.CompleteMultipartUpload", race)
    assert objects.put_if_absent("blobs/cd/big", data) is False
    assert completed_first
    assert objects.get("blobs/cd/big") == data
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_large_downloads_fetch_the_remaining_ranges_in_parallel(s3, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_MULTIPART_THRESHOLD", str(MIB))
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(MIB))
    objects = open_objects(s3.uri())
    data = bytes(range(256)) * (3 * MIB // 256 + 7)
    s3.client.put_object(Bucket=s3.bucket, Key="run/blobs/ab/big", Body=data)
    ranges = []
    objects.client.meta.events.register(
        "before-send.s3.GetObject", lambda request, **_: ranges.append(request.headers["Range"].decode())
    )
    assert objects.get("blobs/ab/big") == data
    assert ranges[0] == f"bytes=0-{MIB - 1}"
    assert sorted(ranges[1:]) == [f"bytes={MIB}-{2 * MIB - 1}", f"bytes={2 * MIB}-{3 * MIB - 1}",
                                  f"bytes={3 * MIB}-{len(data) - 1}"]  # fmt: skip


def test_touch_rewrites_only_objects_older_than_the_freshen_interval(objects, monkeypatch):
    objects.put_if_absent("blobs/ab/x", b"data")
    copies = inject_faults(objects.client, "CopyObject", (500, "Unused"), times=0)
    assert objects.touch("blobs/ab/x") == 4  # just written: young enough; its size
    assert copies.seen == []
    monkeypatch.setenv("CKPTSTORE_S3_FRESHEN_AFTER", "0")
    time.sleep(1.1)
    before = objects.info("blobs/ab/x").mtime
    assert objects.touch("blobs/ab/x") == 4
    assert len(copies.seen) == 1
    assert objects.info("blobs/ab/x").mtime > before
    assert objects.get("blobs/ab/x") == b"data"


def test_touching_objects_too_big_for_one_copy_copies_them_in_parts(s3, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_MULTIPART_THRESHOLD", str(MIB))
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(5 * MIB))
    monkeypatch.setenv("CKPTSTORE_S3_FRESHEN_AFTER", "0")
    monkeypatch.setattr(s3_backend, "_COPY_LIMIT", MIB)  # stands in for S3's 5 GiB
    objects = open_objects(s3.uri())
    data = b"\x02" * (6 * MIB)
    objects.put_if_absent("blobs/ab/big", data)
    time.sleep(1.1)
    before = objects.info("blobs/ab/big").mtime
    assert objects.touch("blobs/ab/big") == len(data)
    assert objects.info("blobs/ab/big").mtime > before
    assert objects.get("blobs/ab/big") == data


def test_touch_of_an_object_deleted_meanwhile_says_it_is_gone(objects, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_FRESHEN_AFTER", "0")
    objects.put_if_absent("blobs/ab/x", b"data")

    def delete_first(request, **_):
        objects.client.delete_object(Bucket=objects.bucket, Key="run/blobs/ab/x")

    objects.client.meta.events.register("before-send.s3.CopyObject", delete_first)
    assert objects.touch("blobs/ab/x") is None


def test_opening_without_create_needs_an_existing_store(s3):
    with pytest.raises(NotFoundError, match=f"no store at s3://{s3.bucket}/run"):
        S3ObjectStore(s3.uri(), create=False)
    S3ObjectStore(s3.uri()).put_if_absent("config.json", b"{}")
    assert S3ObjectStore(s3.uri(), create=False).get("config.json") == b"{}"
