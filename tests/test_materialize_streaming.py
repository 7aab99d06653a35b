"""Materialize streams: files are written a parameter at a time, never the whole model in memory."""

import tracemalloc

import torch

import ckptstore
from ckptstore.deepspeed.torchfile import pwrite_all, save_skeleton, storage_bytes
from tools.engines import batches, build_engine, train


def test_a_skeleton_filled_storage_by_storage_loads_like_torch_save(tmp_path):
    flat = torch.arange(24, dtype=torch.float32)
    original = {
        "flat": flat,
        "view": flat[:10],  # shares flat's storage, as ZeRO's unpadded fp32 partitions do
        "same": flat,
        "bf16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16).reshape(7, 1),
        "step": torch.tensor(5.0),  # scalar tensors in optimizer state
        # the skeleton is read back weights-only: containers, not arbitrary objects
        "inside": {"scale": torch.tensor([2, 3], dtype=torch.int64), "name": "scaler"},
        "nested": [{"empty": torch.empty(0)}, (torch.ones(3, dtype=torch.float16),)],
    }
    path = tmp_path / "file.pt"
    storages = save_skeleton(original, path)
    assert len(storages) == 5  # one per distinct non-empty storage
    with open(path, "r+b") as f:
        for storage, offset in storages:
            pwrite_all(f.fileno(), storage_bytes(storage), offset)

    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["flat"], flat) and torch.equal(loaded["view"], flat[:10])
    assert loaded["view"].untyped_storage().data_ptr() == loaded["flat"].untyped_storage().data_ptr()
    assert loaded["same"] is loaded["flat"]
    assert torch.equal(loaded["bf16"], original["bf16"]) and loaded["step"].item() == 5.0
    assert loaded["inside"]["scale"].tolist() == [2, 3] and loaded["inside"]["name"] == "scaler"
    assert loaded["nested"][0]["empty"].numel() == 0 and loaded["nested"][1][0].tolist() == [1, 1, 1]


def test_an_unfilled_skeleton_takes_no_disk_and_reads_as_zeros(tmp_path):
    path = tmp_path / "big.pt"
    save_skeleton({"big": torch.empty(50_000_000, dtype=torch.float32)}, path)  # 200 MB, never touched
    assert path.stat().st_size > 200_000_000
    assert path.stat().st_blocks * 512 < 1_000_000  # a hole, not 200 MB of zeros written
    assert torch.count_nonzero(torch.load(path, weights_only=True)["big"]) == 0


def test_materialize_holds_a_few_parameters_at_a_time_not_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "2")  # two parameters in flight
    # ZeRO-2 on one rank: the optimizer file is one flat partition holding every parameter,
    # which a plain torch.save would need in memory at once.
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=8, hidden=256, vocab=256)
    train(engine, batches(2, vocab=256))
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=2)
    stored = sum(index.raw_size for index in store.catalog.layer_packs(2))
    largest = max(p.numel() for p in engine.module.parameters()) * 4

    tracemalloc.start()  # traces numpy buffers and zstd output: every decoded tensor
    try:
        store.materialize(2, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert stored > 40 * largest  # the model is many parameters, so the bound below means something
    assert peak < stored / 5, f"peak traced memory {peak} of {stored} stored bytes"
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=1, num_layers=8, hidden=256, vocab=256)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == 2
