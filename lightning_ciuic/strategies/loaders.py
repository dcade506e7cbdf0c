"""HybridParallelStrategy's data-loader glue: every loader split over the data-parallel ranks only.

Contract: :func:`process_dataloader(strategy, dataloader)` checks a pipelined training loader's batch size against the
micro-batches, points the loader at the data-parallel world (:func:`~lightning_ciuic.data.world.point_loader`:
Lightning's samplers, LitData's streaming datasets, the user's ``DistributedSampler`` s and ``set_data_parallel``
datasets; its notes said once, by rank zero), arms the replica's batch check for training loaders
(:mod:`~lightning_ciuic.data.check`), keeps a map-style training loader's position for every checkpoint
(:func:`~lightning_ciuic.data.resume.keep_position`), and returns the training loader wrapped for the pipeline's stages
(:func:`~lightning_ciuic.data.stages.stage_loader`), any other loader as it was. :func:`sampler_kwargs(strategy)`
is the strategy's ``distributed_sampler_kwargs``: the data-parallel replicas and this rank's index among them, read from
the ``dp`` mesh, or, before the processes exist (what ``trainer.estimated_stepping_batches`` asks while a Trainer is
built), from the layout over the world size.

:func:`continue_where_the_loader_resumed(trainer)` (the strategy's ``on_train_start``, before the first batch): where
a restore moved the training loader to another batch of its epoch than the saved loop counters say (a state from
another data-parallel size: ``resume_batch``, :mod:`~lightning_ciuic.data.resume`), the epoch loop's batch counters
move there, so the epoch ends when the loader does: neither early (its remaining batches skipped, or LitData's stream
replayed from the restored state in the next epoch) nor late.

Lightning is imported here (the strategy's glue).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ciuic import compat
from lightning_ciuic.data.resume import keep_position, take_resume_batch
from lightning_ciuic.data.stages import stage_loader
from lightning_ciuic.data.world import DataParallelWorld, point_loader
from lightning_ciuic.parallel.axes import Axis

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy


def process_dataloader(strategy: HybridParallelStrategy, dataloader: object) -> object:
    batch_size = getattr(dataloader, "batch_size", None)
    training = strategy.lightning_module.trainer.state.stage == RunningStage.TRAINING
    if strategy.pipeline is not None and training and isinstance(batch_size, int):
        strategy.pipeline.check_batch_size(batch_size, where=f"the {type(dataloader).__name__}'s batch_size")
    whole = DataParallelWorld(strategy.global_rank, strategy.world_size)
    report = point_loader(dataloader, strategy.data_parallel_world, whole)
    for note in report.notes:
        rank_zero_info(f"HybridParallelStrategy: {report.description}: {note}.")
    if not training:
        return dataloader
    strategy.batch_check.arm(report)
    trainer = strategy.lightning_module.trainer
    dataloader = keep_position(dataloader, lambda: compat.epoch_position(trainer))  # every checkpoint resumes at its batch
    return stage_loader(dataloader, strategy.pipeline, strategy.lightning_module)


def continue_where_the_loader_resumed(trainer: Trainer) -> None:
    batch = take_resume_batch(trainer.train_dataloader)
    if batch is not None:
        compat.set_batches_processed(trainer, batch)


def sampler_kwargs(strategy: HybridParallelStrategy) -> dict[str, Any]:
    if strategy.meshes is not None:
        dp_mesh = strategy.meshes.mesh(Axis.DP)
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}
    dims = strategy.parallelism.resolve(strategy.num_nodes * max(1, strategy.num_processes))
    return {"num_replicas": dims.dp, "rank": dims.dp_rank_of(strategy.global_rank)}
