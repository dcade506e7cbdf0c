"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) directories plus a small metadata file.

Contract (collective calls: every rank calls them with the same ``path``):

* ``save_sharded(path, model, optimizers, meta, rank_state, rank_key, write_meta)`` writes the model's and
  optimizers' state as DCP shards under fully qualified parameter names (so another parallel layout can
  load them), ``rank_state`` — tensors only this rank owns, such as error-feedback residuals — under
  ``rank_key``, and, on the rank with ``write_meta``, the non-tensor ``meta`` to ``meta.pt``.
* ``load_sharded(path, model, optimizers, rank_key)`` loads them in place into the (already built and
  sharded) model and optimizers and returns ``(meta, rank_state)``; ``rank_state`` is None when the
  checkpoint has none for ``rank_key`` (another world size, or saved without it). A directory without
  ``meta.pt`` is rejected with an error naming the path.

No Lightning imports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META_FILE = "meta.pt"


def _tensor_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    state.update({f"optimizer_{i}": get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)})
    return state


def save_sharded(
    path: Path,
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
    meta: dict[str, Any],
    rank_state: Optional[dict[str, torch.Tensor]],
    rank_key: str,
    write_meta: bool,
) -> None:
    tensors: dict[str, Any] = {"state_dict": model_state}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
    if rank_state:
        tensors[rank_key] = rank_state
    dcp.save(tensors, checkpoint_id=str(path))
    if write_meta:
        torch.save(meta, path / META_FILE)


def load_sharded(
    path: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], rank_key: str
) -> tuple[dict[str, Any], Optional[dict[str, torch.Tensor]]]:
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a HybridParallelStrategy checkpoint (a directory with {META_FILE} and DCP shards);"
            " pass a path written by trainer.save_checkpoint or ModelCheckpoint under this strategy."
        )
    state = _tensor_state(model, optimizers)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = rank_key + "."
    owned = {k[len(prefix) :]: torch.empty(saved[k].size) for k in saved if k.startswith(prefix)}
    if owned:
        state[rank_key] = owned
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["state_dict"])
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"])
    return torch.load(path / META_FILE, weights_only=False), state.get(rank_key)
