"""The local part of a tensor that may be a DTensor.

Contract: :func:`local_tensor` returns this rank's shard of a ``DTensor`` (no communication) and any other tensor
unchanged; ``None`` passes through (a parameter without a gradient). :func:`device_of` is the device a rank computes
on for a mesh. No Lightning imports.
"""

from __future__ import annotations

from typing import Optional, overload

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@overload
def local_tensor(tensor: torch.Tensor) -> torch.Tensor: ...
@overload
def local_tensor(tensor: None) -> None: ...
def local_tensor(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh`` (CUDA-like meshes: the current device, as FSDP2 uses)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
