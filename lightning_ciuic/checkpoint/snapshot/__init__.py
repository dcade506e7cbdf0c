"""Snapshots of one rank's training state, kept where the fault being handled cannot reach them.

Four rooms, one concern each (every name is importable from here):

- :mod:`.format`: the checksummed bytes of one snapshot (``encode_snapshot`` / ``write_snapshot``,
  ``decode_snapshot`` raising :class:`CorruptSnapshotError`, ``snapshot_header``);
- :mod:`.stores`: where they are kept (``MemoryStore``, ``ShmStore`` on ``/dev/shm``) and the reaper that frees a
  run's shared memory when its owner exits (``claim_run_directory``);
- :mod:`.plans`: which one to restore (``recovery_order`` for a rollback, ``plan_restores`` over every rank's
  :class:`Holding` s for a restart, into the same or another data-parallel size);
- :mod:`.peers`: copies in a peer's memory on another node (``peer_of``, ``exchange``) and snapshots moved to the
  rank that lost them (``transfer``).

No Lightning imports.
"""

from lightning_ciuic.checkpoint.snapshot.format import (
    COMPRESSIONS,
    CorruptSnapshotError,
    StateCompression,
    decode_snapshot,
    encode_snapshot,
    snapshot_header,
    write_snapshot,
)
from lightning_ciuic.checkpoint.snapshot.peers import exchange, peer_of, transfer
from lightning_ciuic.checkpoint.snapshot.plans import Holding, RestorePlan, plan_restores, recovery_order
from lightning_ciuic.checkpoint.snapshot.stores import MemoryStore, ShmStore, claim_run_directory

__all__ = [
    "COMPRESSIONS", "CorruptSnapshotError", "Holding", "MemoryStore", "RestorePlan", "ShmStore", "StateCompression",
    "claim_run_directory", "decode_snapshot", "encode_snapshot", "exchange", "peer_of", "plan_restores",
    "recovery_order", "snapshot_header", "transfer", "write_snapshot",
]
