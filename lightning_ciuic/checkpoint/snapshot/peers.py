"""Snapshots sent between ranks: a copy in a peer's memory, and a snapshot moved to the rank that lost it.

Contract: :func:`peer_of` pairs each rank with one on another node (the next node's rank with the same local
rank; on a single node, the next rank). :func:`exchange` sends this rank's snapshot to its peer and receives the
snapshot of the rank it is peer to, so a copy of every rank's state lives in another node's memory and survives
losing a node. :func:`transfer` moves one snapshot from its holder to the rank that lost it. Both are collectives
over a (gloo) group. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist


def peer_of(rank: int, world_size: int, local_world_size: int) -> int:
    """The rank that keeps a copy of ``rank``'s snapshots: the same local rank on the next node, or the next
    rank when there is one node (which then survives losing a process, not losing the node)."""
    shift = local_world_size if world_size > local_world_size else 1
    return (rank + shift) % world_size


def _send_bytes(blob: bytes, dst: int, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Start sending ``blob`` (its length, then its bytes); wait on the returned requests."""
    requests = [dist.isend(torch.tensor([len(blob)], dtype=torch.int64), dst, group=group)]
    if blob:
        requests.append(dist.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group))
    return requests


def _recv_bytes(src: int, group: Optional[dist.ProcessGroup]) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.recv(data, src, group=group)
    return data.numpy().tobytes()


def exchange(blob: bytes, rank: int, world_size: int, local_world_size: int, group: Optional[dist.ProcessGroup] = None) -> bytes:
    """Collective over ``group`` (global ranks): send ``blob`` to :func:`peer_of` this rank and return the blob of
    the rank this one is peer to."""
    peer = peer_of(rank, world_size, local_world_size)
    source = next(r for r in range(world_size) if peer_of(r, world_size, local_world_size) == rank)
    requests = _send_bytes(blob, peer, group)
    received = _recv_bytes(source, group)
    for request in requests:
        request.wait()
    return received


def transfer(moves: Iterable[tuple[int, int]], rank: int, blob_for: Any, group: Optional[dist.ProcessGroup] = None) -> dict[int, bytes]:
    """Collective: for each ``(holder, owner)`` in the same order on every rank, ``holder`` sends
    ``blob_for(owner)`` to ``owner``. Returns the blobs this rank received, by owner."""
    received = {}
    for holder, owner in moves:
        if rank == holder:
            for request in _send_bytes(blob_for(owner), owner, group):
                request.wait()
        elif rank == owner:
            received[owner] = _recv_bytes(holder, group)
    return received
