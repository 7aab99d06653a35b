"""What killed writers leave behind is found and, once older than the grace period, removed.

A commit killed between writing an object's ``.tmp`` file and linking it leaves the ``.tmp``
file (24-48 MB at 25M parameters); a killed ``catalog rebuild`` leaves
``catalog.db.rebuild-<hex>.tmp``; on S3 a killed multipart upload stays open. ``verify`` counts
them as information, ``gc`` removes those older than its grace period (``--dry-run`` says so).
"""

from __future__ import annotations

import json
import os
import time

import pytest

import ckptstore

HOUR = 3600


@pytest.fixture(scope="module")
def engine(zero1_engine):
    return zero1_engine


def leave(path, size: int, age: float = 0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.fixture
def littered(tmp_path, engine):
    """A store with step 1 and what killed writers left: three old leftovers and a young one."""
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=1)
    root = store.objects.root
    old = [
        leave(root / "packs" / "ab" / f"{'ab' * 16}.{'0' * 32}.tmp", 1000, age=2 * HOUR),
        leave(root / "catalog.db.rebuild-0badf00d.tmp", 200, age=2 * HOUR),
        leave(root / "catalog.db.rebuild-0badf00d.tmp-wal", 100, age=2 * HOUR),
    ]
    young = leave(root / "packs" / "cd" / f"{'cd' * 16}.{'1' * 32}.tmp", 50)  # a commit writing now
    return store, old, young


def test_verify_counts_unfinished_writes_as_information(littered, run):
    store, old, young = littered
    report = store.verify()
    assert report.ok and report.temporary == 4 and report.temporary_bytes == 1350
    assert report.orphans == [] and report.stray_objects == []  # never mistaken for objects
    result = run("--store", store.objects.uri, "verify")
    assert result.returncode == 0
    assert "info: 4 unfinished write(s) (1.3 KiB), in flight or left by killed commands" in result.stdout
    assert json.loads(run("--store", store.objects.uri, "verify", "--json").stdout)["temporary"] == 4


def test_gc_removes_unfinished_writes_older_than_the_grace_period(littered, run, tmp_path):
    store, old, young = littered
    dry = run("--store", store.objects.uri, "gc", "--dry-run", "--grace", "1h")
    assert dry.returncode == 0 and "would remove 3 unfinished write(s) left by killed commands" in dry.stdout
    assert all(path.exists() for path in [*old, young])

    report = store.gc(grace=HOUR)
    assert report.temporary_freed == 3 and report.temporary_bytes_freed == 1300
    assert not any(path.exists() for path in old) and young.exists()
    assert store.verify().ok and store.verify().temporary == 1
    assert (store.materialize(1, tmp_path / "out") / "latest").read_text() == "global_step1"
    as_json = json.loads(run("--store", store.objects.uri, "gc", "--grace", "0", "--json").stdout)
    assert as_json["temporary_freed"] == 1 and not young.exists()


def test_a_delete_never_removes_unfinished_writes(littered):
    store, old, young = littered
    store.delete(1)  # no grace period applies to what delete frees: it sweeps nothing young or old
    assert all(path.exists() for path in [*old, young])


def test_gc_aborts_multipart_uploads_a_killed_commit_left_open_on_s3(s3, engine):
    store = ckptstore.open(s3.uri())
    store.commit(engine, step=1)
    client, key = store.objects.client, f"run/packs/ab/{'ab' * 16}"
    upload = client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=s3.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1000)
    assert store.verify().temporary == 1

    # (moto reports every upload as initiated in 2010, so its age cannot be tested here)
    assert store.gc(grace=HOUR, dry_run=True).temporary_freed == 1
    assert client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    assert store.gc(grace=HOUR).temporary_freed == 1
    assert not client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    assert store.verify().ok and store.verify().temporary == 0 and store.steps() == [1]
