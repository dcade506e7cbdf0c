"""Side process groups: a gloo group beside training's, for a component's own small collectives.

:func:`close_group` closes one together: every rank waits at a barrier first (a rank that leaves while a peer's gloo
connection is open makes that peer abort), unless a peer may be gone after a failure, where a barrier could wait for
it forever. No Lightning imports.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


def close_group(group: Optional[dist.ProcessGroup], together: bool = True) -> None:
    if group is None or not dist.is_initialized():
        return
    if together:
        dist.barrier(group=group)
    dist.destroy_process_group(group)
