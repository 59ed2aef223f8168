"""ckptd as a ``torch.distributed.checkpoint`` storage backend: ``StorageWriter`` and ``StorageReader``.

    import torch.distributed.checkpoint as dcp
    from ckptd_client.dcp import StorageReader, StorageWriter

    writer = StorageWriter("llama3")                     # one per process, reused save after save
    dcp.save(state, checkpoint_id="step-100", storage_writer=writer)     # or dcp.async_save
    dcp.load(state, checkpoint_id="step-100", storage_reader=StorageReader("llama3"))

A step written this way is an ordinary ckptd step (``ckptd ls/verify/inspect/export``): each rank's
write items go through its ``Checkpointer``'s slots to its node's daemon as pieces of global
tensors (DCP's byte items as uint8 pieces), and the daemon commits the step (one index.json after
every rank is durable). DCP's ``Metadata`` is rebuilt from the index's tensor map and a small
JSON record in the coordinator's state tree (``meta.py``); nothing is pickled by ckptd. DCP's own
``load_bytes`` unpickles byte items (Python objects in the state), as it does with any storage.
"""
from .reader import StorageReader
from .writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
