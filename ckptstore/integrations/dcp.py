"""PyTorch Distributed Checkpoint's storage contract, served by a store: ``dcp.save`` and
``dcp.load`` (FSDP2, DTensor tensor parallelism, torchtitan...) read and write store steps.

    store = ckptstore.open("s3://ckpts/run7")                       # every rank
    dcp.save(state, storage_writer=StoreWriter(store, step=300))
    dcp.save(state, storage_writer=StoreWriter(store, step=400, layers=["model.layers.1"]))
    dcp.load(state, storage_reader=StoreReader(store, step=400))   # step=None: the newest

The public front door: how saving works is ``ckptstore.dcp.writer``'s to say, how loading
works ``ckptstore.dcp.reader``'s.
"""

from ..dcp.reader import StoreReader
from ..dcp.writer import StoreWriter

__all__ = ["StoreReader", "StoreWriter"]
