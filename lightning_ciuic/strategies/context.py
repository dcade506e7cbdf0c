"""ParallelContext: the one object callbacks ask about the parallel layout of a running Trainer.

Contract: ``parallel_context(trainer)`` returns a frozen :class:`ParallelContext` with the degrees
(:class:`~lightning_ciuic.parallel.dims.ParallelDims`), the device mesh (``None`` outside
``HybridParallelStrategy``), the data-parallel process group (``None`` where ``dp == 1``; the default group
under ``DDPStrategy``), the data-parallel engine (``None`` where the strategy has none of ours), the pipeline
runner (``None`` without pipeline parallelism), the experts' layout (``experts``: the
:class:`~lightning_ciuic.parallel.experts.ExpertLayout` of expert parallelism, with its expert-parallel modules, the
meshes their tokens and gradients cross and the dispatch's counters; ``None`` without expert parallelism), the
replica's equal-batch check (``batch_check``, :mod:`~lightning_ciuic.data.check`; ``None`` under another strategy)
and the device of this rank; ``dp_rank`` / ``dp_size`` are what loaders split data by. Under ``HybridParallelStrategy`` it
is the strategy's own description; under any other strategy (``DDPStrategy``, one device) every rank is a
data-parallel replica of the whole model. Callbacks read these fields instead of probing strategy attributes.

``step_vote(trainer)`` is the Trainer's one :class:`~lightning_ciuic.comm.vote.StepVote`: callbacks that must agree
every step (recovery's health check, elastic's preemption flags, the async checkpointer's "save now?") register
their values into it and the ranks exchange one message per step for all of them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.comm.vote import StepVote
from lightning_ciuic.data.check import EqualBatchCheck
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.experts import ExpertLayout

if TYPE_CHECKING:
    from lightning_ciuic.parallel.pipeline import PipelineRunner


@dataclass(frozen=True)
class ParallelContext:
    dims: ParallelDims
    mesh: Optional[DeviceMesh]
    dp_group: Optional[dist.ProcessGroup]
    data_parallel: Optional[DataParallel]
    pipeline: Optional["PipelineRunner"]
    device: torch.device
    experts: Optional[ExpertLayout] = None  # expert parallelism's layout (dims.ep > 1)
    batch_check: Optional[EqualBatchCheck] = None  # the replica's ranks compare their batches (data/check.py)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        return dist.get_rank(self.dp_group) if self.dp_group is not None else 0

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas: with :attr:`dp_rank`, what a loader splits its data by
        (docs/data.md)."""
        return self.dims.dp

    def axis_of_group(self) -> dict[str, str]:
        """Process-group name -> mesh axis, for the axes with more than one rank."""
        mesh = self.mesh
        if mesh is None or mesh.mesh_dim_names is None:
            return {}
        return {mesh.get_group(axis).group_name: axis for i, axis in enumerate(mesh.mesh_dim_names) if mesh.size(i) > 1}


def parallel_context(trainer: Trainer) -> ParallelContext:
    """The running Trainer's :class:`ParallelContext` (see the module docstring)."""
    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, HybridParallelStrategy) and strategy.parallel_dims is not None:
        dims, meshes, parallelized = strategy.parallel_dims, strategy.meshes, strategy.parallelized
        assert meshes is not None
        return ParallelContext(
            dims=dims, mesh=meshes.world, dp_group=meshes.mesh(Axis.DP).get_group() if dims.dp > 1 else None,
            data_parallel=strategy.data_parallel, pipeline=strategy.pipeline, device=strategy.root_device,
            experts=parallelized.experts if parallelized is not None else None, batch_check=strategy.batch_check,
        )
    world = trainer.world_size
    group = dist.group.WORLD if world > 1 and dist.is_initialized() else None
    return ParallelContext(
        dims=ParallelDims(pp=1, dp=world, tp=1, world_size=world), mesh=None, dp_group=group, data_parallel=None,
        pipeline=None, device=strategy.root_device,
    )


_votes: "weakref.WeakKeyDictionary[Trainer, StepVote]" = weakref.WeakKeyDictionary()


def step_vote(trainer: Trainer) -> StepVote:
    """The Trainer's one per-step vote (created on first use; its control group on the first registration)."""
    vote = _votes.get(trainer)
    if vote is None:
        vote = _votes[trainer] = StepVote()
    return vote


def batch_end_vote(trainer: Trainer, name: str, pl_module: Any, outputs: Any, batch_idx: int) -> tuple[float, ...]:
    """``name``'s values summed over the ranks at this ``on_train_batch_end``.

    Providers are called as ``provider(trainer, pl_module, outputs)``. The batch is identified by
    ``(epoch, batch_idx)``, which a rollback of the step counter does not change, so every callback asking in the
    same hook reads the same exchange.
    """
    return step_vote(trainer).result(name, (trainer.current_epoch, batch_idx), trainer, pl_module, outputs)
