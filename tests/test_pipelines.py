"""How commit and materialize spend the machine: compressing and decoding on one thread per
core, waits on disks and networks overlapping them, the largest tensors first."""

import threading
import time

import pytest

import ckptstore
from ckptstore.format import codec, pack
from tools.engines import batches, build_engine, train


class Concurrency:
    """Counts how many threads are inside the wrapped function at once."""

    def __init__(self, function, pause: float = 0.0):
        self.function, self.pause = function, pause
        self.now = self.most = 0
        self.lock = threading.Lock()
        self.calls = []

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.calls.append(args)
        try:
            time.sleep(self.pause)
            return self.function(*args, **kwargs)
        finally:
            with self.lock:
                self.now -= 1


def committed_engine():
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, batches(1))
    return engine


def test_compression_uses_one_thread_per_core_while_more_threads_write(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_CPU_THREADS", "1")
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "4")
    store = ckptstore.open(tmp_path / "store")
    encoding = Concurrency(codec.encode_parts)
    writing = Concurrency(store.objects.put_if_absent, pause=0.02)  # a slow disk
    monkeypatch.setattr(codec, "encode_parts", encoding)
    monkeypatch.setattr(store.objects, "put_if_absent", writing)
    store.commit(committed_engine(), step=1)
    assert len(encoding.calls) > 10
    assert encoding.most == 1  # never more compressing threads than CPU_THREADS
    assert writing.most > 1  # while blobs wait on the disk, the next one is compressed


def test_ranks_on_one_machine_split_its_cores_when_they_commit(tmp_path, monkeypatch):
    engine = committed_engine()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks here, committing at once
    monkeypatch.setenv("CKPTSTORE_CPU_THREADS", "2")
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "4")
    store = ckptstore.open(tmp_path / "store")
    encoding = Concurrency(codec.encode_parts, pause=0.005)
    monkeypatch.setattr(codec, "encode_parts", encoding)
    store.commit(engine, step=1)
    assert len(encoding.calls) > 10 and encoding.most == 1


def test_the_largest_packs_are_compressed_first(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "1")  # one thread: the order is the schedule
    store = ckptstore.open(tmp_path / "store")
    encoding = Concurrency(pack.spill)
    monkeypatch.setattr(pack, "spill", encoding)
    store.commit(committed_engine(), step=1)
    sizes = [sum(t.numel() * t.element_size() for *_, t in items) for items, *_ in encoding.calls]
    assert len(sizes) > 3 and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_materialize_decodes_on_one_thread_per_core_largest_parameters_first(tmp_path, monkeypatch):
    store = ckptstore.open(tmp_path / "store")
    store.commit(committed_engine(), step=1)
    monkeypatch.setenv("CKPTSTORE_CPU_THREADS", "1")
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "4")
    decoding = Concurrency(codec.decode, pause=0.005)
    monkeypatch.setattr(codec, "decode", decoding)
    store.materialize(1, tmp_path / "out")
    assert len(decoding.calls) > 10 and decoding.most == 1
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "1")
    decoding.calls.clear()
    store.materialize(1, tmp_path / "again")
    sizes = [codec.parse_header(blob).raw_size for blob, *_ in decoding.calls]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_local_reads_share_the_cores_and_network_reads_wait_outside_them(
    where, tmp_path, monkeypatch, request
):
    # Reading a tensor's range of a local pack copies it out of the page cache, CPU work like
    # decoding; an S3 read waits on the network, and many may wait at once.
    if where == "s3":
        monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "cache"))
        store = ckptstore.open(request.getfixturevalue("s3").uri())
    else:
        store = ckptstore.open(tmp_path / "store")
    store.commit(committed_engine(), step=1)
    monkeypatch.setenv("CKPTSTORE_CPU_THREADS", "1")
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "4")
    reading = Concurrency(store.objects.get_range, pause=0.01)
    monkeypatch.setattr(store.objects, "get_range", reading)
    store.materialize(1, tmp_path / "out")
    if where == "local":  # a mapped ranged read per tensor
        assert len(reading.calls) > 10 and reading.most == 1
    else:  # a pack's head, then its entries in one read: a read per pack at least, all waiting at once
        packs = {ref.key for index in store.catalog.layer_packs(1) for ref in index.packs}
        assert len(packs) <= len(reading.calls) <= 2 * len(packs) and reading.most > 1


def test_a_commit_stores_each_pack_from_its_spill_file_never_joined_in_memory(tmp_path, monkeypatch):
    from ckptstore.objects import FileRange

    monkeypatch.setenv("CKPTSTORE_PACK_BYTES", str(64 * 1024))  # many packs, several tensors each
    store = ckptstore.open(tmp_path / "store")
    written = Concurrency(store.objects.put_if_absent)
    monkeypatch.setattr(store.objects, "put_if_absent", written)
    store.commit(committed_engine(), step=1)
    packs = [(name, data) for name, data, *_ in written.calls if name.startswith("packs/")]
    assert len(packs) > 3
    for name, data in packs:
        # In memory: the pack's head (preamble and index); its blobs are a range of the spill file.
        head, body = data
        assert isinstance(body, FileRange) and body.length > len(head), name
        assert store.objects.info(name).size == len(head) + body.length
    assert store.verify(deep=True).ok
