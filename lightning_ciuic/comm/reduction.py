"""ReductionGroup: one set of parameters whose gradients a data-parallel engine averages over one mesh.

Contract: a :class:`ReductionGroup` is a frozen record (compared by identity: it holds tensors) of

* ``name``: what the group is (``"dense"``: the model's parameters over the data-parallel ranks; ``"experts"``: the
  routed experts' over the ranks holding the same experts);
* ``parameters``: the parameters, in the module's registration order (the frozen ones too: the replicas' start
  broadcasts them; only those that require gradients are averaged);
* ``mesh``: the ranks they are averaged over (a one-dimensional mesh for whole replicas; for sharded groups the
  mesh of their FSDP2 units);
* ``compression``: how the replicated engine compresses their buckets (:class:`~lightning_ciuic.comm.compression.CompressionConfig`;
  the sharded engine's codec is FSDP2's reduce dtype and its quantized reduce-scatter, DiLoCo's its outer codec);
* ``units``: for a sharded group, the FSDP2 units whose reduce-scatters average its parameters (inner units first,
  the roots last); empty for whole replicas.

An engine's ``setup(module, groups, stages)`` takes every group of a model at once; the first is the model's own
(``"dense"``: the replicas' buffers follow its mesh, ``"auto"`` measures it), the others are averaged beside it.
The engine's ``stats`` and ``payload()`` add up every group's. A new kind of reduction (ZeRO-1/2 shards, another
expert layout) is a new group, not a new argument of the engines. :func:`~lightning_ciuic.comm.engines.reduction_groups`
makes a parallelized model's groups. No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.comm.compression import CompressionConfig


@dataclass(frozen=True, eq=False)
class ReductionGroup:
    """Parameters averaged over one mesh, compressed one way (see the module docstring)."""

    name: str
    parameters: tuple[nn.Parameter, ...]
    mesh: DeviceMesh
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    units: tuple[nn.Module, ...] = ()

    @property
    def axis(self) -> str:
        """The mesh's axis names, as errors and timelines name the ranks (``"dp"``, ``"edp"``)."""
        return "x".join(self.mesh.mesh_dim_names or (self.name,))
