"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), on a directory or any DCP storage.

Contract (collective calls: every rank of ``process_group`` calls them for the same checkpoint):

* ``save_sharded(model_state, optimizer_states, meta, rank_state, rank_key, ...)`` writes the model's and
  optimizers' state as DCP shards under fully qualified parameter names (so another parallel layout can
  load them), ``rank_state`` — tensors only this rank owns, such as error-feedback residuals — under
  ``rank_key``, and the non-tensor Lightning state ``meta`` as one pickled object, the first rank's of the group. A tensor every rank holds is
  written once, by the rank DCP balances writes to, or with ``lowest_rank`` by the lowest (replicas that differ:
  the checkpoint then holds one consistent replica). Where: ``checkpoint_id``
  (a directory, DCP's file-system format) or ``storage_writer`` (e.g. the chunked fsspec writer of
  :mod:`lightning_ciuic.checkpoint.dcp`).
* ``load_sharded(model, optimizers, rank_key, ..., strict=True)`` loads them in place into the (already built and
  sharded) model and optimizers and returns ``(meta, rank_state)``: ``meta`` is Lightning's whole checkpoint dict
  (``state_dict`` and ``optimizer_states`` as loaded, beside the saved rest); ``rank_state`` is None when the
  checkpoint has none for ``rank_key`` (another world size, or saved without it). A directory that is not such a
  checkpoint is rejected with an error naming the path. ``strict``: the checkpoint's parameters must be the
  model's, no more and no fewer (else a ``ValueError`` names the differences); otherwise only the common ones load.
* ``load_whole(model, optimizers, checkpoint, strict=True)``: the same from Lightning's single-file checkpoint dict
  (every tensor whole; optimizer states keyed by index, as ``Optimizer.state_dict()`` writes them, or by name),
  into any layout; a pipeline stage loads its part (:func:`optimizer_state_by_name` says how positions are named).
* ``optimizer_state_by_name(model, optimizer, saved)``: an ``Optimizer.state_dict()`` keyed by parameter name.
* ``optimizer_state(model, optimizer)``: torch's ``get_optimizer_state_dict`` without its side effect: for an
  optimizer with no state and no gradients it runs a step with zero gradients and then ``zero_grad()``; here a
  stateless optimizer saves an empty state instead.
* ``lightning_checkpoint(saved)``: a whole saved state (as ``checkpoint.dcp.load_full`` reads it, in one process)
  as Lightning's checkpoint dict: ``state_dict``, ``optimizer_states`` and the unpickled rest
  (``hyper_parameters``, ``global_step``, ...).

No Lightning imports.
"""

from __future__ import annotations

import pickle
import warnings
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
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor

from lightning_ciuic.parallel.pipeline import OnAnotherStage, persistent_buffer_names

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
    state: dict[str, Any] = {"state_dict": model_state}
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        # Lightning's state, one opaque item, written by the group's first rank (the first pipeline stage, whose
        # loaders read: a middle stage's never iterate, so their positions are not the run's)
        state[META_KEY] = pickle.dumps(meta)
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
    strict: bool = True,
) -> tuple[dict[str, Any], Optional[dict[str, torch.Tensor]]]:
    reader = storage_reader or dcp.FileSystemReader(str(checkpoint_id))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (FileNotFoundError, NotADirectoryError) as err:
        raise FileNotFoundError(
            f"{checkpoint_id} is not a HybridParallelStrategy checkpoint (a DCP directory); pass a path written by"
            " trainer.save_checkpoint or ModelCheckpoint under this strategy."
        ) from err
    model_state = get_model_state_dict(model)
    saved_names = {k[len("state_dict.") :] for k in saved if k.startswith("state_dict.")}
    check_same_parameters(model, model_state.keys(), saved_names, strict)
    state: dict[str, Any] = {"state_dict": {k: v for k, v in model_state.items() if k in saved_names}, META_KEY: b""}
    own_names: dict[int, list[list[str]]] = {}
    for i, optimizer in enumerate(optimizers):  # an empty saved state (saved before any step) loads as empty
        has_state = any(k.startswith(f"optimizer_{i}.state.") for k in saved)
        template = get_optimizer_state_dict(model, optimizer) if has_state else optimizer_state(model, optimizer)
        if not strict:
            template["state"] = {k: v for k, v in template["state"].items() if k in saved_names}
        # A group's "params" (its parameters' names) is one key for every rank, saved once: a pipeline stage's names
        # are not another's, so each rank loads the hyperparameters only and keeps its own names.
        own_names[i] = [group.pop("params") for group in template["param_groups"]]
        state[f"optimizer_{i}"] = template
    prefix = rank_key + "."
    # In host memory, in the saved dtype: the engine moves what it loads to its own device.
    owned = {k[len(prefix) :]: torch.empty(saved[k].size, dtype=saved[k].properties.dtype) for k in saved if k.startswith(prefix)}
    if owned:
        state[rank_key] = owned
    dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    for i, names in own_names.items():
        for group, params in zip(state[f"optimizer_{i}"]["param_groups"], names):
            group["params"] = params
    options = StateDictOptions(strict=strict)
    set_model_state_dict(model, state["state_dict"], options=options)
    loaded = [state[f"optimizer_{i}"] for i in range(len(optimizers))]
    if not strict and not all(map(_fits, optimizers, loaded)):
        _optimizers_start_afresh()
        loaded = []
    for optimizer, optimizer_state_dict in zip(optimizers, loaded):
        set_optimizer_state_dict(model, optimizer, optimizer_state_dict, options=options)
    meta = pickle.loads(state[META_KEY])
    meta.update(state_dict=state["state_dict"], optimizer_states=[state[f"optimizer_{i}"] for i in range(len(optimizers))])
    return meta, state.get(rank_key)


def load_whole(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], checkpoint: dict[str, Any], strict: bool = True
) -> dict[str, Any]:
    """Lightning's single-file checkpoint into any layout (see the module docstring); returns it."""
    saved = checkpoint["state_dict"]
    check_same_parameters(model, get_model_state_dict(model).keys(), saved.keys(), strict)
    optimizer_states = checkpoint.get("optimizer_states", [])
    if not strict and not all(map(_fits, optimizers, optimizer_states)):
        _optimizers_start_afresh()
        optimizer_states = []
    elsewhere = on_other_stages(model)
    if not elsewhere and not any(isinstance(p, DTensor) for p in model.parameters()):  # Lightning's own way
        model.load_state_dict(saved, strict=strict)
        for optimizer, optimizer_saved in zip(optimizers, optimizer_states):
            optimizer.load_state_dict(optimizer_saved)
        return checkpoint
    # Whole tensors into this rank's shards, or this pipeline stage's part of the model.
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, {k: v for k, v in saved.items() if not k.startswith(elsewhere)}, options=options)
    for optimizer, optimizer_saved in zip(optimizers, optimizer_states):
        by_name = _held_by(model, optimizer, optimizer_state_by_name(model, optimizer, optimizer_saved, saved.keys()))
        if by_name["state"]:
            set_optimizer_state_dict(model, optimizer, by_name, options=options)
        else:  # no per-parameter state (plain SGD): torch's whole-state loading finds no tensor to take a device from
            for group, saved_group in zip(optimizer.param_groups, by_name["param_groups"]):
                group.update({key: value for key, value in saved_group.items() if key != "params"})
    return checkpoint


def on_other_stages(model: torch.nn.Module) -> tuple[str, ...]:
    """The name prefixes (``"model.layers.2."``) of the blocks that live on other pipeline stages; () without any."""
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, OnAnotherStage))


def _held_by(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A by-name optimizer state restricted to the parameters ``optimizer`` holds (a stage's share of the model's)."""
    held = set(_names_in_order(model, optimizer))
    return {
        "state": {k: v for k, v in state["state"].items() if k in held},
        "param_groups": [{**g, "params": [n for n in g["params"] if n in held]} for g in state["param_groups"]],
    }


def _optimizers_start_afresh() -> None:
    warnings.warn(
        "strict_loading=False and the checkpoint's optimizer states are of another set of parameters: the model's"
        " common tensors are loaded, the optimizers start afresh.",
        stacklevel=3,
    )


def _fits(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> bool:
    """Whether a saved optimizer state has this optimizer's parameter groups, size for size."""
    groups = saved.get("param_groups", [])
    return len(groups) == len(optimizer.param_groups) and all(
        len(g["params"]) == len(mine["params"]) for g, mine in zip(groups, optimizer.param_groups)
    )


def check_same_parameters(model: torch.nn.Module, model_names: Any, saved_names: Any, strict: bool) -> None:
    """With ``strict``, a checkpoint of another architecture is an error naming what differs (the tensors of blocks
    that live on other pipeline stages are expected in it, not here)."""
    elsewhere = on_other_stages(model)
    missing = sorted(set(model_names) - set(saved_names))
    unexpected = sorted(n for n in set(saved_names) - set(model_names) if not n.startswith(elsewhere))
    if strict and (missing or unexpected):
        raise ValueError(
            f"the checkpoint is of another model: {len(missing)} of this model's tensors are not in it"
            f" {missing[:5]}, and it holds {len(unexpected)} this model does not have {unexpected[:5]}. Load a"
            " checkpoint of this architecture, or set `self.strict_loading = False` on the LightningModule to load"
            " the tensors both have."
        )


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict`` without running a step on a stateless optimizer (see the module docstring)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or not params or any(p.grad is not None for p in params):
        return get_optimizer_state_dict(model, optimizer)
    params[0].grad = torch.zeros_like(params[0])  # torch initialises only an optimizer without state and gradients
    try:
        return get_optimizer_state_dict(model, optimizer)
    finally:
        params[0].grad = None


def optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], saved_names: Any = None
) -> dict[str, Any]:
    """An ``Optimizer.state_dict()`` (parameters by index) keyed by parameter name, as torch's state-dict API takes it.

    The index is a position in the optimizer that saved it: this ``optimizer``'s own order where it holds as many
    parameters, else (a pipeline stage, which holds part of them) the order of the checkpoint's tensors
    ``saved_names`` less the model's persistent buffers (other stages' blocks included), where they are as many as the
    saved positions."""
    groups = saved.get("param_groups", [])
    if not groups or not groups[0]["params"] or isinstance(groups[0]["params"][0], str):
        return saved
    order = _names_in_order(model, optimizer)
    positions = sum(len(group["params"]) for group in groups)
    if len(order) != positions:
        buffers = persistent_buffer_names(model)
        held, order = len(order), [name for name in saved_names or () if name not in buffers]
        if len(order) != positions:
            raise ValueError(
                f"the checkpoint's optimizer state is keyed by position ({positions} parameters) and this rank's"
                f" optimizer holds {held} of them (a pipeline stage's share), and its {len(order)} saved tensors that"
                " are not this model's buffers do not say which positions are which. Resume with pipeline_parallel_size=1,"
                " or from a checkpoint this strategy wrote sharded (a directory: keyed by name), or set"
                " `self.strict_loading = False` to load the weights and start the optimizers afresh."
            )
    return {
        "state": {order[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in groups],
    }


def _names_in_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in ``model``, in the optimizer's order (its state's positions)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def lightning_checkpoint(saved: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict from a whole state written by :func:`save_sharded` (see the module docstring)."""
    if META_KEY not in saved or "state_dict" not in saved:
        return saved  # not written by save_sharded (e.g. ChunkedCheckpointIO.save_checkpoint of a plain dict)
    checkpoint = pickle.loads(saved[META_KEY])
    optimizers = sorted((k for k in saved if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return {**checkpoint, "state_dict": saved["state_dict"], "optimizer_states": [saved[k] for k in optimizers]}
