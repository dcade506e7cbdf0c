"""The names of the device mesh's axes: one enum, so no module spells an axis as a string of its own.

Contract: :class:`Axis` is a ``StrEnum``: each member *is* its string (``Axis.TP == "tp"``, ``mesh[Axis.TP]``
works, a member prints as its value), so torch's ``DeviceMesh`` takes it wherever it takes a name.

* ``PP``: pipeline stages; ``DP_REPLICATE`` x ``DP_SHARD``: data-parallel replicas of the model's shards (HSDP;
  FSDP where ``DP_REPLICATE`` is 1, whole replicas where ``DP_SHARD`` is 1); ``DP``: the two flattened, every
  data-parallel rank (what samplers and replica-wide collectives use); ``TP``: tensor-parallel peers, innermost.
* The expert view of the same world (expert parallelism, :meth:`~lightning_ciuic.parallel.dims.ParallelDims.build`):
  ``EP``: ranks that hold different experts of one layer and exchange tokens, carved from the innermost
  data-parallel axis; ``EDP``: what is left of that axis, ranks holding the same experts (their gradients are averaged
  over it, and over ``DP_REPLICATE``; sharded, FSDP2 shards the experts over it); ``EP_DP``: the data-parallel part of
  ``EP`` when ``EP`` also takes the tensor-parallel peers (``EP`` is then ``EP_DP x TP`` flattened).
* :data:`MESH_ALIASES`: the names Lightning's ``ModelParallelStrategy`` gives the same axes, so a module written
  for it (``self.device_mesh["data_parallel"]``) runs unchanged.

No Lightning imports.
"""

from __future__ import annotations

from enum import StrEnum


class Axis(StrEnum):
    PP = "pp"
    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"
    EP = "ep"
    EDP = "edp"
    EP_DP = "ep_dp"  # the data-parallel part of ep when ep also takes the tp peers


MESH_ALIASES: dict[str, Axis] = {"data_parallel": Axis.DP, "tensor_parallel": Axis.TP}
