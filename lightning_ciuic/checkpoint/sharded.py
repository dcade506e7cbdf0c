"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), on a directory or any DCP storage.

Contract (collective calls: every rank of ``process_group`` calls them for the same checkpoint):

* ``save_sharded(model_state, optimizer_states, meta, rank_state, rank_key, ...)`` writes the model's and
  optimizers' state as DCP shards under fully qualified parameter names (so another parallel layout can
  load them), ``rank_state`` — tensors only this rank owns, such as error-feedback residuals — under
  ``rank_key``, and the non-tensor Lightning state ``meta`` as one pickled object. A tensor every rank holds is
  written once, by the rank DCP balances writes to, or with ``lowest_rank`` by the lowest (replicas that differ:
  the checkpoint then holds one consistent replica). Where: ``checkpoint_id``
  (a directory, DCP's file-system format) or ``storage_writer`` (e.g. the chunked fsspec writer of
  :mod:`lightning_ciuic.checkpoint.dcp`).
* ``load_sharded(model, optimizers, rank_key, ...)`` loads them in place into the (already built and
  sharded) model and optimizers and returns ``(meta, rank_state)``; ``rank_state`` is None when the
  checkpoint has none for ``rank_key`` (another world size, or saved without it). A directory that is not
  such a checkpoint is rejected with an error naming the path.
* ``lightning_checkpoint(saved)``: a whole saved state (as ``checkpoint.dcp.load_full`` reads it, in one process)
  as Lightning's checkpoint dict: ``state_dict``, ``optimizer_states`` and the unpickled rest
  (``hyper_parameters``, ``global_step``, ...).

No Lightning imports.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

META_KEY = "meta"


def save_sharded(
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
    meta: dict[str, Any],
    rank_state: Optional[dict[str, torch.Tensor]],
    rank_key: str,
    checkpoint_id: Optional[Path] = None,
    storage_writer: Optional[StorageWriter] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    lowest_rank: bool = False,
) -> None:
    state: dict[str, Any] = {"state_dict": model_state, META_KEY: pickle.dumps(meta)}  # one opaque item, not flattened
    state.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
    if rank_state:
        state[rank_key] = rank_state
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=lowest_rank)
    dcp.save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer, process_group=process_group, planner=planner)


def load_sharded(
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    rank_key: str,
    checkpoint_id: Optional[Path] = None,
    storage_reader: Optional[StorageReader] = None,
) -> tuple[dict[str, Any], Optional[dict[str, torch.Tensor]]]:
    reader = storage_reader or dcp.FileSystemReader(str(checkpoint_id))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (FileNotFoundError, NotADirectoryError) as err:
        raise FileNotFoundError(
            f"{checkpoint_id} is not a HybridParallelStrategy checkpoint (a DCP directory); pass a path written by"
            " trainer.save_checkpoint or ModelCheckpoint under this strategy."
        ) from err
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model), META_KEY: b""}
    state.update({f"optimizer_{i}": get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)})
    prefix = rank_key + "."
    # In host memory, in the saved dtype: the engine moves what it loads to its own device.
    owned = {k[len(prefix) :]: torch.empty(saved[k].size, dtype=saved[k].properties.dtype) for k in saved if k.startswith(prefix)}
    if owned:
        state[rank_key] = owned
    dcp.load(state, storage_reader=reader)
    set_model_state_dict(model, state["state_dict"])
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"])
    return pickle.loads(state[META_KEY]), state.get(rank_key)


def lightning_checkpoint(saved: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict from a whole state written by :func:`save_sharded` (see the module docstring)."""
    if META_KEY not in saved or "state_dict" not in saved:
        return saved  # not written by save_sharded (e.g. ChunkedCheckpointIO.save_checkpoint of a plain dict)
    checkpoint = pickle.loads(saved[META_KEY])
    optimizers = sorted((k for k in saved if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return {**checkpoint, "state_dict": saved["state_dict"], "optimizer_states": [saved[k] for k in optimizers]}
