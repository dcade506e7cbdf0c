"""The local part of a tensor that may be a DTensor.

Contract: :func:`local_tensor` returns this rank's shard of a ``DTensor`` (no communication) and any other tensor
unchanged; ``None`` passes through (a parameter without a gradient). No Lightning imports.
"""

from __future__ import annotations

from typing import Optional, overload

import torch
from torch.distributed.tensor import DTensor


@overload
def local_tensor(tensor: torch.Tensor) -> torch.Tensor: ...
@overload
def local_tensor(tensor: None) -> None: ...
def local_tensor(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
