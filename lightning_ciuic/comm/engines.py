"""The data-parallel engine of a parallelized model: its reduction groups and the one place the engine is chosen.

Contract:

* :func:`reduction_groups(parallelized, compression)`: the :class:`~lightning_ciuic.comm.reduction.ReductionGroup` s
  of what :func:`~lightning_ciuic.parallel.parallelize.parallelize` made: ``"dense"`` (every parameter but the
  routed experts', over the data-parallel mesh: ``"dp"``, or sharded the FSDP2 mesh with the non-expert units and
  the roots), then under expert parallelism ``"experts"`` (the experts' parameters over
  :attr:`~lightning_ciuic.parallel.experts.ExpertLayout.data_mesh`, the ranks holding the same experts; sharded,
  with the experts' own FSDP2 units). Without expert parallelism there is the dense group alone.
* :func:`build_engine(parallelized, config)`: that model's engine, set up over those groups, as the strategy runs
  it and the planner measures it: :class:`~lightning_ciuic.comm.sharded.Sharded` where there are FSDP2 units,
  else none without data parallelism, else :class:`~lightning_ciuic.comm.diloco.DiLoCoEngine` with
  ``config.diloco``, else :class:`~lightning_ciuic.comm.data_parallel.Replicated` (``config.bucket_size_mb``,
  ``config.sync_timeout``). ``config`` has :class:`EngineOptions` (a :class:`~lightning_ciuic.config.ParallelismConfig`) with the run's
  precision applied (``with_precision``: FSDP2's dtypes). Collective over the data-parallel ranks (the replicas'
  start is broadcast from the first).

No Lightning imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

from lightning_ciuic.comm.compression import CompressionConfig
from lightning_ciuic.comm.data_parallel import DataParallel, Replicated
from lightning_ciuic.comm.diloco import DiLoCo, DiLoCoEngine
from lightning_ciuic.comm.reduction import ReductionGroup
from lightning_ciuic.comm.sharded import Sharded
from lightning_ciuic.parallel.fsdp import ShardingConfig

if TYPE_CHECKING:
    from lightning_ciuic.parallel.parallelize import Parallelized


class EngineOptions(Protocol):
    """What :func:`build_engine` reads of a layout's options (``ParallelismConfig``, above comm/, has them)."""

    @property
    def sharding(self) -> ShardingConfig: ...

    @property
    def compression(self) -> CompressionConfig: ...

    @property
    def diloco(self) -> Optional[DiLoCo]: ...

    @property
    def bucket_size_mb(self) -> float: ...

    @property
    def sync_timeout(self) -> float: ...


def reduction_groups(parallelized: Parallelized, compression: CompressionConfig) -> list[ReductionGroup]:
    """The model's dense group, then its experts' (see the module docstring)."""
    module, experts, layout = parallelized.module, parallelized.experts, parallelized.fsdp
    expert_ids = experts.parameter_ids() if experts is not None else set()
    dense = tuple(p for p in module.parameters() if id(p) not in expert_ids)
    if layout is None:
        groups = [ReductionGroup("dense", dense, parallelized.meshes.data_parallel_mesh, compression)]
    else:
        expert_units = {id(m) for m in experts.modules.values()} if experts is not None else set()
        units = tuple(u for u in (*layout.units, *layout.roots) if id(u) not in expert_units)
        groups = [ReductionGroup("dense", dense, layout.mesh, compression, units)]
    if experts is not None:
        units = tuple(experts.modules.values()) if layout is not None else ()
        groups.append(ReductionGroup("experts", tuple(experts.parameters()), experts.data_mesh, compression, units))
    return groups


def build_engine(parallelized: Parallelized, config: EngineOptions) -> Optional[DataParallel]:
    """The engine of ``parallelized``, set up (see the module docstring); ``None`` without data parallelism."""
    engine: DataParallel
    if parallelized.fsdp is not None:
        engine = Sharded(config.sharding)
    elif not parallelized.dims.dp_enabled:
        return None
    elif config.diloco is not None:
        engine = DiLoCoEngine(config.diloco)
    else:
        engine = Replicated(config.bucket_size_mb, config.sync_timeout)
    engine.setup(parallelized.module, reduction_groups(parallelized, config.compression), parallelized.stages)
    return engine
