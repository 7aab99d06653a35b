"""Lossless deltas: a commit stores what changed since this process's previous commit as the XOR
of its bits with that version's, and every read gives back exactly the tensor stored.

A store with deltas (the default) and one without (``CKPTSTORE_DELTA_CHAIN=1``) take the same
engine states; every read of every step of the first equals the second's, file for file and
bit for bit, at every position of a chain and after gc dropped the steps in its middle. A read
decodes at most ``CKPTSTORE_DELTA_CHAIN`` objects per piece; ``verify`` names a broken base
with every step that needs it.
"""

from __future__ import annotations

import pytest
import torch

import ckptstore
from ckptstore.errors import CorruptError
from ckptstore.format import codec, pack, planes
from ckptstore.format.layout import pack_name
from ckptstore.materialize.fetch import fetch_pack_index
from tests.test_gc import load_checkpoint_files, same
from tools.engines import batches, build_engine, destroy_engine, train

CHAIN = 3
STEPS = range(1, 8)


# -- the format -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_delta_decodes_to_exactly_the_tensor_and_is_far_smaller_when_few_bits_moved(dtype):
    torch.manual_seed(0)
    before = torch.randn(4096).to(dtype)
    after = (before.float() * (1 + 1e-4 * torch.randn(4096))).to(dtype)
    base = codec.raw_bytes(before).copy()
    key, parts = codec.encode_delta_parts(after, base)
    blob = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert key == codec.tensor_key(after)
    assert codec.parse_header(blob).codec == codec.XOR_PLANES
    assert len(blob) < 0.7 * len(codec.encode(after)[1])
    itemsize = after.element_size()
    decoded = codec.decode(blob, key, base=lambda size: planes.split_planes(base, itemsize))
    assert torch.equal(decoded.view(torch.uint8), after.view(torch.uint8))
    with pytest.raises(CorruptError, match="without its base"):
        codec.decode(blob, key)
    other = codec.raw_bytes(torch.zeros(4096, dtype=dtype)).copy()
    with pytest.raises(CorruptError, match="does not hash to its key"):
        codec.decode(blob, key, base=lambda size: planes.split_planes(other, itemsize))
    with pytest.raises(CorruptError, match="base holds"):
        codec.decode(blob, key, base=lambda size: planes.split_planes(base[:-itemsize], itemsize))


def test_a_packs_key_covers_its_entries_bases_and_its_index_names_only_pack_keys():
    tensor = torch.arange(8, dtype=torch.float32)
    key = codec.tensor_key(tensor)
    whole = pack.pack_key([("w", "fp32", 0, key)])
    delta = pack.pack_key([("w", "fp32", 0, key, "a" * 32)])
    assert len({whole, delta, pack.pack_key([("w", "fp32", 0, key, "b" * 32)])}) == 3
    body = codec.encode(tensor, key)[1]
    pack_of, parts, entries = pack.assemble([("w", "fp32", 0, key, "a" * 32, [body])])
    data = b"".join(parts)
    assert pack_of == delta and entries[0].base == "a" * 32
    assert pack.parse_index(data, delta)[0].base == "a" * 32
    tampered = data.replace(b"a" * 32, b"b" * 32)
    with pytest.raises(CorruptError, match="does not hash"):
        pack.parse_index(tampered, delta)
    with pytest.raises(CorruptError, match="malformed pack index"):
        pack.parse_index(data.replace(b"a" * 32, b"x" * 31 + b'"'), None)
    # A base names an object, so it is held to the store's rule for names: 32 hex digits.
    for name in (b"../../../../../../../etc/passwd", b"A" * 32, b"a" * 31 + b"/"):
        with pytest.raises(CorruptError, match="no pack key"):
            pack.parse_index(data.replace(b"a" * 32, name.ljust(32, b"x")[:32]), None)


# -- the planning of a commit ---------------------------------------------------------------------


def stored_entries(objects, stored):
    """Every entry the packs of ``stored`` (a ``StoredPacks``) hold."""
    return [
        entry
        for packs in stored.layers.values()
        for ref, _ in packs
        for entry in fetch_pack_index(objects, ref).values()
    ]


def test_a_piece_is_a_delta_only_against_a_version_of_its_dtype_still_stored(tmp_path):
    from ckptstore.commit.deltas import Versions
    from ckptstore.commit.packs import store_pieces
    from ckptstore.model import Piece

    objects = ckptstore.open(tmp_path / "store").objects
    versions = Versions()
    weight = torch.randn(4096)

    def commit(tensor):
        return store_pieces(objects, 0, [Piece("layers.0.w", "fp32", 0, tensor)], versions=versions)

    commit(weight)
    second = commit(weight * (1 + 1e-6))
    (entry,) = stored_entries(objects, second)
    assert entry.base is not None and second.bases  # a delta, and the layer lists its base
    # The same bytes as bf16 elements: a delta's planes are its base's, so it is stored whole.
    moved = weight.view(torch.bfloat16) + 1
    (entry,) = stored_entries(objects, commit(moved))
    assert entry.base is None
    moved[:8] += 1  # a few elements move: a delta that pays
    (entry,) = stored_entries(objects, commit(moved))
    assert entry.base is not None
    # Its base swept since (a gc between two commits): the next version is stored whole.
    objects.delete(pack_name(entry.base))
    moved[8:16] += 1
    (entry,) = stored_entries(objects, commit(moved))
    assert entry.base is None


# -- commits every step, read back --------------------------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The same engine states committed at steps 1..7 with deltas (chain of 3) and without."""
    root = tmp_path_factory.mktemp("deltas")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTSTORE_DELTA_CHAIN", str(CHAIN))
        with_deltas = ckptstore.open(root / "deltas")
        whole = ckptstore.open(root / "whole")
        engine = build_engine("llama", zero_stage=2, dtype="bf16", num_layers=2, lr=1e-4)
        data = batches(len(STEPS))
        for step in STEPS:
            train(engine, data[step - 1 : step])
            with_deltas.commit(engine, step)
            patch.setenv("CKPTSTORE_DELTA_CHAIN", "1")
            whole.commit(engine, step)
            patch.setenv("CKPTSTORE_DELTA_CHAIN", str(CHAIN))
        destroy_engine(engine)
    return root, with_deltas, whole


def depths(store, step: int) -> dict[tuple[str, str, int], int]:
    """Objects a read decodes for each piece of ``step``: 1 for a whole entry, 1 + its base's."""
    found = {}
    for index in store.catalog.layer_packs(step):
        entries = {}
        for ref in index.all_packs:
            entries[ref.key] = fetch_pack_index(store.objects, ref)
        for ref in index.packs:
            for where, entry in entries[ref.key].items():
                depth = 1
                while entry.base is not None:
                    entry = entries[entry.base][where]
                    depth += 1
                found[where] = depth
    return found


def test_changed_pieces_are_stored_as_deltas_in_chains_no_longer_than_the_setting(stores):
    _, with_deltas, whole = stores
    longest = {step: max(depths(with_deltas, step).values()) for step in STEPS}
    assert longest[1] == 1  # the first commit of a process has nothing to be a delta of
    assert max(longest.values()) == CHAIN
    added = {step: sum(r.bytes for r in with_deltas.show(step)) for step in STEPS}
    whole_added = {step: sum(r.bytes for r in whole.show(step)) for step in STEPS}
    assert sum(added.values()) < sum(whole_added.values())
    # Every piece's full version counts: the size of a step is what its own packs hold.
    assert with_deltas.verify().ok and whole.verify().ok


def test_every_step_of_a_chain_reads_back_bit_for_bit(stores, tmp_path):
    _, with_deltas, whole = stores
    for step in STEPS:
        a = with_deltas.state_dict(step, dtype=None)
        b = whole.state_dict(step, dtype=None)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    for step in (2, 4, 7):
        ours = load_checkpoint_files(with_deltas.materialize(step, tmp_path / f"d{step}"))
        theirs = load_checkpoint_files(whole.materialize(step, tmp_path / f"w{step}"))
        assert same(ours, theirs), step
    exported = with_deltas.export(7, tmp_path / "e7", dtype="float32").path
    reference = whole.export(7, tmp_path / "x7", dtype="float32").path
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == {
        p.name: p.read_bytes() for p in reference.iterdir()
    }


def test_a_restore_at_the_end_of_a_chain_equals_one_from_whole_pieces(stores):
    _, with_deltas, whole = stores
    restored = []
    for store in (with_deltas, whole):
        engine = build_engine("llama", zero_stage=2, dtype="bf16", num_layers=2, lr=1e-4)
        store.restore(engine, 7)
        restored.append(engine.optimizer.state_dict())
        destroy_engine(engine)
    assert same(*restored)


def test_gc_of_a_chains_middle_keeps_the_bases_later_steps_need(stores, tmp_path):
    root, with_deltas, whole = stores
    copy = ckptstore.open(root / "deltas")
    report = copy.gc(keep_steps=[1, 7], keep_last=1, grace=0)
    assert report.steps_dropped == [2, 3, 4, 5, 6]
    assert copy.verify().ok
    for step in (1, 7):
        a, b = copy.state_dict(step, dtype=None), whole.state_dict(step, dtype=None)
        assert all(torch.equal(a[k], b[k]) for k in a), step
    ours = load_checkpoint_files(copy.materialize(7, tmp_path / "d7"))
    assert same(ours, load_checkpoint_files(whole.materialize(7, tmp_path / "w7")))


def test_verify_names_a_broken_base_with_every_step_that_needs_it(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", num_layers=2, lr=1e-4)
    for step, batch in enumerate(batches(3), start=1):
        train(engine, [batch])
        store.commit(engine, step)
    destroy_engine(engine)
    first = {ref.key: ref for index in store.catalog.layer_packs(1) for ref in index.packs}
    base, entry = next(
        (first[e.base], e)
        for index in store.catalog.layer_packs(2)
        for ref in index.packs
        for e in fetch_pack_index(store.objects, ref).values()
        if e.base in first
    )  # a step-1 pack that a step-2 delta is against
    (path,) = (tmp_path / "store").rglob(base.key)
    own = fetch_pack_index(store.objects, base)[(entry.name, entry.kind, entry.start)]
    data = bytearray(path.read_bytes())
    data[own.offset + own.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = store.verify()
    # Only the base is broken: the deltas' own packs are whole, and are not reported.
    assert [p.blob for p in report.problems] == [base.key], [p.describe() for p in report.problems]
    assert "corrupt" in report.problems[0].describe()
    needing = [s for s in (1, 2, 3) if any(base in i.all_packs for i in store.catalog.layer_packs(s))]
    assert needing[:2] == [1, 2]
    assert report.problems[0].describe().endswith(f"needed by steps {', '.join(map(str, needing))}")
    with pytest.raises(CorruptError, match=base.key):
        store.materialize(2, tmp_path / "out")


# -- policy versions through DCP ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_policy_versions_saved_through_dcp_are_deltas_and_load_back_exactly(tmp_path):
    """An RL-style run: each step's bf16 weights, a few of them moved by a small update, are
    saved with ``dcp.save``; each later version stores a fraction of the first."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreReader, StoreWriter

    generator = torch.Generator().manual_seed(0)
    weights = {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(256, 128, generator=generator) for i in range(3)
    }
    versions = {}
    with ckptstore.open(tmp_path / "store") as store:
        for step in range(1, 6):
            for tensor in weights.values():  # a fine-tuning update: most bf16 values do not move
                tensor.add_(1e-4 * torch.randn(tensor.shape, generator=generator) * tensor)
            policy = {"model": {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}}
            versions[step] = {name: tensor.clone() for name, tensor in policy["model"].items()}
            dcp.save(policy, storage_writer=StoreWriter(store, step=step))
        added = {row.step: row.bytes_added for row in store.log()}
        # A chain of 4 (the default): steps 2-4 are deltas, step 5 is whole again.
        assert all(added[step] < 0.1 * added[1] for step in (2, 3, 4)), added
        assert max(depths(store, 4).values()) == 4 and max(depths(store, 5).values()) == 1
        for step, expected in versions.items():
            loaded = {"model": {name: torch.zeros_like(tensor) for name, tensor in expected.items()}}
            dcp.load(loaded, storage_reader=StoreReader(store, step=step))
            assert all(torch.equal(loaded["model"][name], expected[name]) for name in expected), step
        report = store.verify()
        assert report.ok, vars(report)
