"""What only the local directory backend does; the shared contract is in test_objects_conformance.py."""

import os

import pytest

from ckptstore.errors import BadInputError, CorruptError, NotFoundError
from ckptstore.objects import local, open_objects
from ckptstore.objects.local import LocalObjectStore


@pytest.fixture
def objects(tmp_path):
    return open_objects(str(tmp_path / "store"))


def test_in_flight_tmp_files_are_never_listed(objects, tmp_path):
    objects.put_if_absent("blobs/ab/done", b"x")
    (tmp_path / "store" / "blobs" / "ab" / "half.1234.tmp").write_bytes(b"partial")
    assert [o.name for o in objects.list("blobs/")] == ["blobs/ab/done"]


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


def test_an_endpoint_is_refused_for_local_stores(tmp_path):
    with pytest.raises(BadInputError, match="s3://"):
        open_objects(str(tmp_path / "store"), endpoint_url="http://127.0.0.1:9000")


def test_a_short_write_goes_on_where_it_stopped(tmp_path, monkeypatch):
    # The kernel may write less than asked (a signal, a full pipe of a network filesystem).
    real_writev = os.writev

    def at_most_seven_bytes(fd, buffers):
        budget, taken = 7, []
        for buffer in buffers:
            piece = memoryview(buffer)[:budget]
            taken.append(piece)
            budget -= piece.nbytes
        return real_writev(fd, taken)

    monkeypatch.setattr(os, "writev", at_most_seven_bytes)
    objects = LocalObjectStore(tmp_path / "store")
    parts = [b"header", b"", bytes(range(50)), b"tail"]
    assert objects.put_if_absent("blobs/ab/short", parts) is True
    assert objects.get("blobs/ab/short") == b"".join(parts)


def test_a_long_range_is_read_in_place_and_outlives_the_file(objects):
    data = os.urandom(5 << 20)
    objects.put_if_absent("packs/ab/big", data)
    start = 123_457  # not on a page boundary
    view = objects.get_range("packs/ab/big", start, 3 << 20)
    assert isinstance(view, memoryview) and view.readonly  # the page cache, mapped, not a copy
    objects.delete("packs/ab/big")  # as gc may, while a restore still reads it
    assert bytes(view) == data[start : start + (3 << 20)]


def test_with_map_bytes_0_a_long_range_is_read_into_bytes(objects, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_MAP_BYTES", "0")
    data = os.urandom(3 << 20)
    objects.put_if_absent("packs/ef/big", data)
    view = objects.get_range("packs/ef/big", 5, 2 << 20)
    assert isinstance(view, bytes) and view == data[5 : 5 + (2 << 20)]


def test_a_long_range_past_the_end_gives_what_there_is(objects):
    data = os.urandom(3 << 20)
    objects.put_if_absent("packs/cd/big", data)
    assert bytes(objects.get_range("packs/cd/big", 1 << 20, 4 << 20)) == data[1 << 20 :]
    assert bytes(objects.get_range("packs/cd/big", 5 << 20, 2 << 20)) == b""


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_long_range_of_a_file_others_may_write_is_read_not_mapped(objects, tmp_path, mode):
    # Someone who may write the file may truncate it under a mapping: a reader of it would die
    # of SIGBUS. Such a file is read into bytes instead, and only this user's own is mapped.
    data = os.urandom(3 << 20)
    objects.put_if_absent("packs/ab/big", data)
    path = tmp_path / "store" / "packs" / "ab" / "big"
    assert isinstance(objects.get_range("packs/ab/big", 7, 2 << 20), memoryview)
    path.chmod(mode)
    view = objects.get_range("packs/ab/big", 7, 2 << 20)
    assert isinstance(view, bytes) and view == data[7 : 7 + (2 << 20)]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_long_range_of_another_users_copy_is_read_not_mapped(objects, tmp_path):
    data = os.urandom(3 << 20)
    objects.put_if_absent("packs/ab/big", data)
    path = tmp_path / "store" / "packs" / "ab" / "big"
    os.chown(path, 65534, 65534)  # a store writer put their own copy in its place
    view = objects.get_range("packs/ab/big", 0, 2 << 20)
    assert isinstance(view, bytes) and view == data[: 2 << 20]


def test_a_pack_truncated_between_open_and_read_is_corrupt_not_a_signal(objects, tmp_path, monkeypatch):
    data = os.urandom(3 << 20)
    objects.put_if_absent("packs/ab/big", data)
    path = tmp_path / "store" / "packs" / "ab" / "big"
    path.chmod(0o664)  # a group member may write it, and truncates it once the reader has it open
    asked, may_map = [], local.may_map

    def truncate_then_answer(st):
        asked.append(may_map(st))
        os.truncate(path, 1 << 20)
        return asked[-1]

    monkeypatch.setattr(local, "may_map", truncate_then_answer)
    with pytest.raises(
        CorruptError, match=r"packs/ab/big .* shrank while it was read \(it had 3145728 bytes"
    ):
        objects.get_range("packs/ab/big", 5, 2 << 20)
    assert asked == [False]  # read, never mapped: had it been mapped, this process would be dead


def test_a_data_reader_reads_buffers_and_file_ranges_as_one_seekable_file(tmp_path):
    # What S3 uploads stream from (a request body, a multipart source): any read size, any seek.
    import io
    import tempfile

    from ckptstore.objects import DataReader, FileRange

    with tempfile.TemporaryFile(dir=tmp_path) as spill:
        spill.write(b"xx" + bytes(range(200)) + b"yy")
        spill.flush()
        parts = [b"head", memoryview(b""), FileRange(spill.fileno(), 2, 200), b"", memoryview(b"tail")]
        whole = b"head" + bytes(range(200)) + b"tail"
        for size in (1, 3, 7, 64, 1000):
            reader, got = DataReader(parts), b""
            while chunk := reader.read(size):
                got += chunk
            assert got == whole, size
        reader = DataReader(parts)
        assert reader.seek(0, io.SEEK_END) == len(whole) and reader.read(5) == b""
        reader.seek(150)
        assert reader.read(100) == whole[150:] and reader.tell() == len(whole)
        reader.seek(2)
        assert reader.read(10) == whole[2:12]
    assert DataReader(memoryview(whole)).read() == whole
