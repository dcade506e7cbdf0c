"""This rank's share of a model's and an optimizer's state, captured as plain CPU tensors and written back in place.

Contract:

* :func:`capture_module` / :func:`capture_optimizer` take this rank's values (a ``DTensor`` contributes its local
  shard) as CPU tensors: copies that share nothing with the live objects, or with ``copy=False`` the live CPU
  tensors themselves (for a caller that serializes them before the next step changes them).
* :func:`restore_module` copies a capture back into the live tensors (same storage: optimizers keep pointing at the
  same parameters). :func:`restore_optimizer` sets hyper-parameters and per-parameter state, creating state an
  optimizer has not made yet (a fresh process after a restart) and dropping state the capture did not have; a
  state tensor shaped like its parameter's shard becomes a ``DTensor`` with the parameter's placements again.
* Both restores need the layout that captured them (same ranks, same parallel plan): that is what a snapshot is
  for. A changed layout is refused with the names that differ; layout changes go through sharded checkpoints.
* :func:`rng_state` / :func:`set_rng_state`: Python, NumPy (when installed) and torch (CPU and CUDA) generators.

No Lightning imports.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_ciuic.tensors import local_tensor


def _taken(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    return local_tensor(tensor).detach().to("cpu", copy=copy)


def capture_module(module: torch.nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    return {name: _taken(value, copy) for name, value in module.state_dict(keep_vars=False).items()}


@torch.no_grad()
def restore_module(module: torch.nn.Module, captured: Mapping[str, torch.Tensor]) -> None:
    live = module.state_dict(keep_vars=True)
    if live.keys() != captured.keys():
        missing, unexpected = sorted(live.keys() - captured.keys()), sorted(captured.keys() - live.keys())
        raise ValueError(f"snapshot does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    for name, tensor in live.items():
        local_tensor(tensor).copy_(captured[name])


def capture_optimizer(optimizer: torch.optim.Optimizer, copy: bool = True) -> dict[str, Any]:
    """Hyper-parameters of each group and, in parameter order, each parameter's state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        "group_sizes": [len(group["params"]) for group in optimizer.param_groups],
        "state": [
            {k: _taken(v, copy) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
            for p in params
        ],
    }


@torch.no_grad()
def restore_optimizer(optimizer: torch.optim.Optimizer, captured: Mapping[str, Any]) -> None:
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != list(captured["group_sizes"]):
        raise ValueError(f"snapshot has parameter groups of sizes {captured['group_sizes']}, the optimizer {sizes}.")
    for group, saved in zip(optimizer.param_groups, captured["param_groups"]):
        group.update(saved)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scalars_on_device = any(optimizer.defaults.get(flag) for flag in ("capturable", "fused"))
    for param, saved_state in zip(params, captured["state"]):
        if not saved_state:
            optimizer.state.pop(param, None)
            continue
        live = optimizer.state[param]
        for key in set(live) - set(saved_state):
            del live[key]
        for key, value in saved_state.items():
            current = live.get(key)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and local_tensor(current).shape == value.shape:
                local_tensor(current).copy_(value)
            elif isinstance(value, torch.Tensor):
                live[key] = _state_tensor(param, value, scalars_on_device)
            else:
                live[key] = value


def _state_tensor(param: torch.Tensor, value: torch.Tensor, scalars_on_device: bool) -> torch.Tensor:
    local_param = local_tensor(param)
    if value.dim() == 0 and not scalars_on_device:  # step counters live on the CPU unless capturable/fused
        return value.clone()
    value = value.to(local_param.device, copy=True)
    if isinstance(param, DTensor) and value.shape == local_param.shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
    return value


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
