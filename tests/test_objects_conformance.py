"""The object-store contract, passed by every backend: a local directory and S3 (loopback moto).

Knobs force S3's multipart path at a few MiB, so large-object edge cases show up here too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ckptstore.errors import BadInputError, NotFoundError
from ckptstore.objects import ObjectStore, open_objects

MIB = 1024 * 1024


@dataclass
class Backend:
    kind: str
    objects: ObjectStore
    open_missing: Callable[[], ObjectStore]  # open a store that does not exist, create=False
    leave_half_written: Callable[[str, bytes], None]  # an interrupted write of ``name``
    make_old: Callable[[str], None]  # after this, freshening must move the object's time forward
    atomic_create: bool  # exactly one of several concurrent creators is told it created the object


@pytest.fixture(params=["local", "s3", "tiered"])
def backend(request, tmp_path, monkeypatch) -> Backend:
    monkeypatch.setenv("CKPTSTORE_S3_MULTIPART_THRESHOLD", str(1 * MIB))
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(5 * MIB))  # S3's (and boto3's) minimum part
    monkeypatch.setenv("CKPTSTORE_S3_FRESHEN_AFTER", "0")
    if request.param in ("local", "tiered"):
        root = tmp_path / "store"

        def leave_half_written(name: str, data: bytes) -> None:
            path = root.joinpath(*name.split("/"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_name(f"{path.name}.1234.tmp").write_bytes(data)

        def make_old(name: str) -> None:
            import os

            os.utime(root.joinpath(*name.split("/")), (1000, 1000))

        if request.param == "tiered":  # a local tier in front of S3: every write lands locally
            from ckptstore.objects.tiered import TieredObjectStore

            s3 = request.getfixturevalue("s3")
            tiered = TieredObjectStore(open_objects(str(root)), open_objects(s3.uri("store")))
            return Backend(
                "tiered", tiered, lambda: open_objects(s3.uri("nope"), create=False),
                leave_half_written, make_old, atomic_create=True,
            )  # fmt: skip
        return Backend(
            "local", open_objects(str(root)), lambda: open_objects(str(tmp_path / "nope"), create=False),
            leave_half_written, make_old, atomic_create=True,
        )  # fmt: skip

    s3 = request.getfixturevalue("s3")
    objects = open_objects(s3.uri("store"))

    def leave_half_written(name: str, data: bytes) -> None:
        # A multipart upload that never completes: its parts are not an object.
        key = f"store/{name}"
        upload = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
        s3.client.upload_part(Bucket=s3.bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)

    def make_old(name: str) -> None:
        time.sleep(1.1)  # S3 times have one-second resolution and cannot be set

    # moto checks If-None-Match and then writes, without a lock: two racing creators can both
    # be told they created the object (AWS S3 tells exactly one). The object is whole either way.
    return Backend(
        "s3", objects, lambda: open_objects(s3.uri("nope"), create=False), leave_half_written, make_old,
        atomic_create=False,
    )  # fmt: skip


def test_put_is_create_only_and_get_returns_the_bytes(backend):
    objects = backend.objects
    assert objects.put_if_absent("blobs/ab/abc", b"one") is True
    assert objects.put_if_absent("blobs/ab/abc", b"two") is False
    assert objects.get("blobs/ab/abc") == b"one"
    assert objects.info("blobs/ab/abc").size == 3
    assert objects.exists("blobs/ab/abc")


def test_memoryviews_and_empty_objects_round_trip(backend):
    objects = backend.objects
    assert objects.put_if_absent("blobs/ee/view", memoryview(b"abcdef")[1:4]) is True
    assert objects.get("blobs/ee/view") == b"bcd"
    assert objects.put_if_absent("blobs/ee/empty", b"") is True
    assert objects.get("blobs/ee/empty") == b""
    assert objects.info("blobs/ee/empty").size == 0


def test_an_object_given_as_a_list_of_buffers_is_their_concatenation(backend):
    import numpy as np

    plane = np.arange(200, dtype=np.uint8)
    parts = [b"head", memoryview(b""), plane, memoryview(b"0123456789")[2:5], b"tail"]
    assert backend.objects.put_if_absent("blobs/ab/parts", parts) is True
    assert backend.objects.get("blobs/ab/parts") == b"head" + plane.tobytes() + b"234" + b"tail"
    big = [bytes(range(256)) * (3 * MIB // 256), b"x" * (3 * MIB)]  # above the multipart threshold
    assert backend.objects.put_if_absent("blobs/ab/bigparts", big) is True
    assert backend.objects.get("blobs/ab/bigparts") == b"".join(big)


def test_parts_spilled_to_a_file_are_copied_from_it_small_or_multipart(backend, tmp_path):
    # A commit spills each pack's blobs to a file and stores head + FileRange: every backend
    # copies the range (from its offset, no further than its length) without joining it first.
    import tempfile

    from ckptstore.objects import FileRange

    body = bytes(range(256)) * (7 * MIB // 256)  # past the multipart threshold, two parts
    with tempfile.TemporaryFile(dir=tmp_path) as spill:
        spill.write(b"junk" + body + b"more junk")
        spill.flush()
        small = [b"head", FileRange(spill.fileno(), 4, 1000), b"tail"]
        assert backend.objects.put_if_absent("packs/ab/small", small) is True
        assert backend.objects.get("packs/ab/small") == b"head" + body[:1000] + b"tail"
        big = [b"head", FileRange(spill.fileno(), 4, len(body))]
        assert backend.objects.put_if_absent("packs/ab/big", big) is True
        assert backend.objects.get("packs/ab/big") == b"head" + body
        assert backend.objects.put_if_absent("packs/ab/big", big) is False
        assert backend.objects.info("packs/ab/big").size == 4 + len(body)
    # A mapped object (what a tier uploads from) is streamed the same way.
    assert backend.objects.put_if_absent("packs/ab/mapped", memoryview(body)) is True
    assert backend.objects.get("packs/ab/mapped") == body


def test_a_range_of_an_object_is_read_alone(backend):
    data = bytes(range(256)) * 8
    backend.objects.put_if_absent("packs/p", data)
    assert backend.objects.get_range("packs/p", 100, 50) == data[100:150]
    assert backend.objects.get_range("packs/p", 0, len(data)) == data
    assert backend.objects.get_range("packs/p", len(data) - 10, 50) == data[-10:]  # cut at the end
    assert backend.objects.get_range("packs/p", len(data) + 5, 10) == b""
    assert backend.objects.get_range("packs/p", 7, 0) == b""
    with pytest.raises(NotFoundError):
        backend.objects.get_range("packs/missing", 0, 10)
    with pytest.raises(NotFoundError):
        backend.objects.get_range("packs/missing", 0, 0)


def test_many_objects_are_deleted_in_one_call_and_missing_ones_are_no_error(backend):
    names = [f"blobs/aa/{i:04d}" for i in range(12)]
    for name in names:
        backend.objects.put_if_absent(name, b"x")
    backend.objects.delete_many([*names[:10], "blobs/aa/missing"])
    assert [info.name for info in backend.objects.list("blobs/")] == names[10:]
    backend.objects.delete_many([])


def test_missing_objects_raise_not_found(backend):
    objects = backend.objects
    with pytest.raises(NotFoundError):
        objects.get("blobs/no/such")
    with pytest.raises(NotFoundError):
        objects.info("blobs/no/such")
    assert not objects.exists("blobs/no/such")
    assert objects.touch("blobs/no/such") is None
    objects.delete("blobs/no/such")  # deleting a missing object is fine


def test_deleted_objects_are_gone(backend):
    objects = backend.objects
    objects.put_if_absent("blobs/ff/gone", b"x")
    objects.delete("blobs/ff/gone")
    assert not objects.exists("blobs/ff/gone")
    assert list(objects.list("blobs/")) == []
    assert objects.put_if_absent("blobs/ff/gone", b"y") is True  # and can be written again


def test_in_flight_writes_are_never_listed(backend):
    backend.objects.put_if_absent("blobs/ab/done", b"x")
    backend.leave_half_written("blobs/ab/half", b"partial")
    assert [o.name for o in backend.objects.list("blobs/")] == ["blobs/ab/done"]
    assert not backend.objects.exists("blobs/ab/half")


def test_an_interrupted_write_is_listed_as_unfinished_until_deleted(backend):
    objects = backend.objects
    objects.put_if_absent("blobs/ab/done", b"x")
    backend.leave_half_written("blobs/ab/half", b"partial")
    [unfinished] = objects.list_temporary()
    assert unfinished.name.startswith("blobs/ab/half") and unfinished.name != "blobs/ab/half"
    objects.delete_temporary([unfinished.name])
    objects.delete_temporary([unfinished.name])  # gone already: not an error
    assert list(objects.list_temporary()) == []
    assert [o.name for o in objects.list("blobs/")] == ["blobs/ab/done"]
    with pytest.raises(BadInputError):
        objects.delete_temporary(["blobs/ab/done"])  # never a finished object
    assert objects.get("blobs/ab/done") == b"x"


def test_listing_gives_every_object_under_a_prefix_in_name_order_with_sizes(backend):
    objects = backend.objects
    for name, data in [("blobs/cd/2", b"22"), ("blobs/ab/1", b"1"), ("manifests/000000000003.json", b"{}")]:
        objects.put_if_absent(name, data)
    assert [(o.name, o.size) for o in objects.list("blobs/")] == [("blobs/ab/1", 1), ("blobs/cd/2", 2)]
    assert [o.name for o in objects.list("blobs/a")] == ["blobs/ab/1"]  # a prefix of names, not folders
    assert [o.name for o in objects.list("manifests/")] == ["manifests/000000000003.json"]
    assert {o.name for o in objects.list()} >= {"blobs/ab/1", "blobs/cd/2", "manifests/000000000003.json"}
    assert list(objects.list("nothing/")) == []
    assert all(abs(o.mtime - time.time()) < 600 for o in objects.list("blobs/"))


def test_names_that_escape_the_store_are_refused(backend):
    for bad in ("../x", "/etc/passwd", "a//b", "blobs/x.tmp", "", "a/./b"):
        with pytest.raises(BadInputError):
            backend.objects.put_if_absent(bad, b"x")
        with pytest.raises(BadInputError):
            backend.objects.get(bad)


def test_two_writers_of_the_same_object_both_succeed_with_one_copy(backend):
    objects = backend.objects
    results = []
    barrier = threading.Barrier(8)

    def write():
        barrier.wait()
        results.append(objects.put_if_absent("blobs/cc/same", b"content"))

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8  # nobody failed
    assert results.count(True) == 1 if backend.atomic_create else results.count(True) >= 1
    assert objects.get("blobs/cc/same") == b"content"
    assert [o.name for o in objects.list("blobs/")] == ["blobs/cc/same"]


def test_reusing_or_touching_an_object_freshens_its_time(backend):
    objects = backend.objects
    objects.put_if_absent("blobs/dd/old", b"x")
    backend.make_old("blobs/dd/old")
    before = objects.info("blobs/dd/old").mtime
    assert objects.put_if_absent("blobs/dd/old", b"x") is False
    reused = objects.info("blobs/dd/old").mtime
    assert reused > before
    backend.make_old("blobs/dd/old")
    before = objects.info("blobs/dd/old").mtime
    assert objects.touch("blobs/dd/old") == 1  # freshened; its size
    assert objects.info("blobs/dd/old").mtime > before
    assert objects.get("blobs/dd/old") == b"x"


def test_large_objects_round_trip_and_stay_create_only(backend):
    # Above the multipart threshold the fixture sets: two parts on S3, one file locally.
    data = bytes(range(256)) * (6 * MIB // 256) + b"tail"
    assert backend.objects.put_if_absent("blobs/99/big", data) is True
    assert backend.objects.get("blobs/99/big") == data
    assert backend.objects.put_if_absent("blobs/99/big", b"other") is False
    assert backend.objects.put_if_absent("blobs/99/big", data[::-1]) is False
    assert backend.objects.info("blobs/99/big").size == len(data)
    assert [o.name for o in backend.objects.list("blobs/")] == ["blobs/99/big"]


def test_opening_a_missing_store_without_create_is_not_found(backend):
    with pytest.raises(NotFoundError, match="no store at"):
        backend.open_missing()
