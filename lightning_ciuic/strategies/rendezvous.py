"""Process-group rendezvous for workers that TorchElastic restarted.

Contract: ``restarted_worker_store(world_size, timeout)`` returns the store ``init_process_group`` should use in a
worker of restart attempt N > 0 under TorchElastic's agent store, and ``None`` otherwise (the usual env:// set-up).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


def restarted_worker_store(world_size: int, timeout: timedelta) -> Optional[dist.Store]:
    """The rendezvous store for a worker that TorchElastic restarted, or ``None`` for the usual env:// set-up.

    TorchElastic's static rendezvous (plain ``torchrun --max-restarts=N``) keeps one agent store across restarts,
    and torch's env:// handler expects a fresh store per attempt, so restarted gloo ranks read the previous
    attempt's peer addresses and fail ("Gloo connectFullMesh failed ... Connection refused"). A key prefix per
    attempt gives each attempt its own namespace in the same store.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"lightning_ciuic/attempt_{attempt}", agent_store)
