"""``torch.distributed.checkpoint`` storage writer and reader over content-addressed chunks on fsspec.

Contract:

* :class:`ChunkedWriter` is a DCP ``StorageWriter``: every rank stores the items of its own plan (tensor
  shards as raw bytes, other objects as DCP's pickled bytes) in the :class:`ChunkStore` (incremental, zstd,
  checksummed); the coordinator writes the metadata and commits the manifest in ``finish`` and then applies
  retention (``max_keep``), so every rank's DCP call returns only once the checkpoint is committed and the
  old ones are gone. ``extra`` (step, epoch) goes into the manifest.
* :class:`ChunkedReader` is the matching ``StorageReader``: any world size and layout can load (DCP
  reshards), every chunk is verified as it is read.
* :func:`save_full` / :func:`load_full`: a whole state (any nested structure) saved and loaded by one process
  (``DDPStrategy`` saves on rank 0; export). Tensors go to chunks like DCP items; the structure is pickled
  with placeholders, so keys keep their types (DCP turns optimizer-state ``int`` keys into strings).
  :func:`load_full` also reads a DCP (sharded) checkpoint into one process, as DCP's structure.

No Lightning imports.
"""

from __future__ import annotations

import io
import math
import pickle
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from lightning_ciuic.checkpoint.incremental import CheckpointCatalog, ChunkStore, Manifest
from lightning_ciuic.compat import EmptyStateDictLoadPlanner, load_state_dict_into


@dataclass(frozen=True)
class ChunkedItem:
    """Where one saved item lives: its chunks, and for a tensor its dtype and shape."""

    chunks: tuple[str, ...]
    dtype: Optional[torch.dtype] = None
    shape: Optional[tuple[int, ...]] = None
    written: int = 0  # stored bytes this save actually wrote for the item (0: every chunk was reused)


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    return tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else b""


def _from_chunks(store: ChunkStore, item: ChunkedItem) -> torch.Tensor:
    """A new CPU tensor holding ``item``, read straight from its verified chunks."""
    tensor = torch.empty(item.shape, dtype=item.dtype, device="cpu")  # a host tensor by contract: read from storage
    if tensor.numel():
        store.read_into(list(item.chunks), tensor)
    return tensor


def _done(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class ChunkedWriter(StorageWriter):
    def __init__(self, store: ChunkStore, name: str, max_keep: Optional[int] = None, extra: Optional[dict] = None) -> None:
        super().__init__()
        self.store, self.name, self.max_keep, self.extra = store, name, max_keep, dict(extra or {})
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.name = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            before = self.store.written_bytes
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getbuffer()
                chunks, dtype, shape = self.store.put(raw), None, None
            else:
                tensor = data.detach().cpu().contiguous()
                raw = _tensor_bytes(tensor)
                chunks, dtype, shape = self.store.put(raw), tensor.dtype, tuple(tensor.shape)
            stored = ChunkedItem(tuple(chunks), dtype, shape, self.store.written_bytes - before)
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=stored))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        chunks = sorted({c for rank in results for r in rank for c in r.storage_data.chunks})
        manifest = Manifest(
            name=self.name,
            created=time.time(),
            step=int(self.extra.get("step", 0)),
            epoch=int(self.extra.get("epoch", 0)),
            chunks=chunks,
            logical_bytes=sum(r.size_in_bytes for rank in results for r in rank),
            written_bytes=sum(r.storage_data.written for rank in results for r in rank),
            world_size=len(results),
            extra={**{k: v for k, v in self.extra.items() if k not in ("step", "epoch")}, "format": "dcp"},
        )
        _commit(self.store, manifest, pickle.dumps(metadata), self.max_keep)

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.name)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class ChunkedReader(StorageReader):
    def __init__(self, store: ChunkStore, name: str) -> None:
        super().__init__()
        self.store, self.name = store, name
        self.storage_data: dict[Any, ChunkedItem] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.name = str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        catalog = CheckpointCatalog(self.store)
        metadata = pickle.loads(catalog.metadata(catalog.get(self.name)))
        metadata.storage_meta = StorageMeta(checkpoint_id=self.name, load_id=self.name)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        for request in plan.items:
            item = self.storage_data[request.storage_index]
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, io.BytesIO(self.store.get(list(item.chunks))))
                continue
            assert item.dtype is not None and item.shape is not None
            target = planner.resolve_tensor(request).detach()
            whole = tuple(request.lengths) == item.shape and not any(request.storage_offsets)
            if whole and target.device.type == "cpu" and target.dtype == item.dtype and target.is_contiguous() \
                    and tuple(target.shape) == item.shape:
                self.store.read_into(list(item.chunks), target)  # the common case: no intermediate copy
            else:
                tensor = _from_chunks(self.store, item)
                for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                    tensor = tensor.narrow(dim, offset, length)  # the part of the saved tensor this request reads
                if target.size() != tensor.size():
                    raise RuntimeError(f"{request.storage_index}: saved shard {tuple(tensor.size())} does not fit {tuple(target.size())}")
                target.copy_(tensor)
            planner.commit_tensor(request, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _commit(store: ChunkStore, manifest: Manifest, metadata: bytes, max_keep: Optional[int]) -> None:
    catalog = CheckpointCatalog(store)
    catalog.commit(manifest, metadata)
    if max_keep is not None:
        catalog.retain(max_keep)


@dataclass(frozen=True)
class _TensorRef:
    index: int


def save_full(
    store: ChunkStore, name: str, state: Any, max_keep: Optional[int] = None, extra: Optional[dict] = None
) -> None:
    """Save ``state`` (tensors anywhere in dicts, lists, tuples) from this process alone and commit it."""
    items: list[ChunkedItem] = []
    written_before = store.written_bytes

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            items.append(ChunkedItem(tuple(store.put(_tensor_bytes(tensor))), tensor.dtype, tuple(tensor.shape)))
            return _TensorRef(len(items) - 1)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = strip(state)
    extra = dict(extra or {})
    manifest = Manifest(
        name=name, created=time.time(), step=int(extra.pop("step", 0)), epoch=int(extra.pop("epoch", 0)),
        chunks=sorted({c for item in items for c in item.chunks}),
        logical_bytes=sum(math.prod(i.shape or ()) * i.dtype.itemsize for i in items if i.dtype is not None),
        written_bytes=store.written_bytes - written_before, extra={**extra, "format": "full"},
    )
    _commit(store, manifest, pickle.dumps({"format": "full", "skeleton": skeleton, "items": items}), max_keep)


def load_full(store: ChunkStore, name: str) -> dict[str, Any]:
    """The whole checkpoint ``name`` as CPU tensors and objects, in this process alone."""
    catalog = CheckpointCatalog(store)
    metadata = pickle.loads(catalog.metadata(catalog.get(name)))
    if isinstance(metadata, dict) and metadata.get("format") == "full":
        items = metadata["items"]

        def fill(value: Any) -> Any:
            if isinstance(value, _TensorRef):
                return _from_chunks(store, items[value.index])
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(fill(v) for v in value)
            return value

        return fill(metadata["skeleton"])
    return load_whole_dcp(ChunkedReader(store, name))


def load_whole_dcp(storage_reader: StorageReader) -> dict[str, Any]:
    """Every tensor and object a DCP checkpoint holds, whole, as CPU tensors, in this process alone (no group)."""
    state: dict[str, Any] = {}
    # What torch's own dcp_to_torch_save does: the empty-state-dict planner rebuilds the saved structure. The public
    # dcp.load cannot: it copies back only the keys the given state dict already had (none), and warns.
    load_state_dict_into(state, storage_reader=storage_reader, planner=EmptyStateDictLoadPlanner(), no_dist=True)
    return state
