"""The object-store contract, for the local directory backend."""

import os
import threading

import pytest

from ckptstore.errors import BadInputError, NotFoundError
from ckptstore.objects import open_objects
from ckptstore.objects.local import LocalObjectStore


@pytest.fixture
def objects(tmp_path):
    return open_objects(str(tmp_path / "store"))


def test_put_is_create_only_and_get_returns_the_bytes(objects):
    assert objects.put_if_absent("blobs/ab/abc", b"one") is True
    assert objects.put_if_absent("blobs/ab/abc", b"two") is False
    assert objects.get("blobs/ab/abc") == b"one"
    assert objects.info("blobs/ab/abc").size == 3


def test_missing_objects_raise_not_found(objects):
    with pytest.raises(NotFoundError):
        objects.get("blobs/no/such")
    assert not objects.exists("blobs/no/such")
    assert objects.touch("blobs/no/such") is False
    objects.delete("blobs/no/such")  # deleting a missing object is fine


def test_in_flight_tmp_files_are_never_listed(objects, tmp_path):
    objects.put_if_absent("blobs/ab/done", b"x")
    (tmp_path / "store" / "blobs" / "ab" / "half.1234.tmp").write_bytes(b"partial")
    assert [o.name for o in objects.list("blobs/")] == ["blobs/ab/done"]


def test_names_that_escape_the_store_are_refused(objects):
    for bad in ("../x", "/etc/passwd", "a//b", "blobs/x.tmp", ""):
        with pytest.raises(BadInputError):
            objects.put_if_absent(bad, b"x")


def test_two_writers_of_the_same_object_both_succeed_with_one_copy(objects):
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
    assert results.count(True) == 1
    assert objects.get("blobs/cc/same") == b"content"
    assert [o.name for o in objects.list("blobs/")] == ["blobs/cc/same"]


def test_reusing_an_object_freshens_its_time(objects, tmp_path):
    objects.put_if_absent("blobs/dd/old", b"x")
    path = tmp_path / "store" / "blobs" / "dd" / "old"
    os.utime(path, (1000, 1000))
    assert objects.put_if_absent("blobs/dd/old", b"x") is False
    assert objects.info("blobs/dd/old").mtime > 1000


def test_opening_a_missing_store_without_create_is_not_found(tmp_path):
    with pytest.raises(NotFoundError):
        LocalObjectStore(tmp_path / "nope", create=False)


def test_unknown_uri_schemes_are_refused():
    with pytest.raises(BadInputError, match="gopher"):
        open_objects("gopher://x/y")
