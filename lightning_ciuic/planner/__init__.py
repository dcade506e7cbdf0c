"""``lightning_ciuic.planner``: check a parallel layout for N ranks in one process, before anyone rents them.

Contract: :func:`plan_layout` takes a module factory (``build(mesh)``: the module on the meta device), the layout
(:class:`~lightning_ciuic.config.ParallelismConfig`), a world size this machine need not have and the module's
optimizers, and returns a :class:`~lightning_ciuic.planner.report.Plan`:

* the layout's errors exactly as ``fit`` raises them (the same ``ParallelDims`` and ``parallelize`` code runs, on
  torch's fake process group);
* for each class of ranks (ranks of one pipeline stage whose figures are equal: tp position, first or last shard,
  ep position...) the local parameters and the bytes of parameters, gradients, optimizer state and the data-parallel
  engine's buffers, exact (:mod:`~lightning_ciuic.planner.layout`), the largest FSDP2 unit gathered, whether that fits
  ``device_memory``, and a warning when shards leave the ranks of a stage uneven by more than 10%;
* with a :class:`~lightning_ciuic.planner.step.StepSpec`, the step phase (:mod:`~lightning_ciuic.planner.step`),
  and with a :class:`~lightning_ciuic.planner.estimate.Hardware` too, the step-time estimate and MFU
  (:mod:`~lightning_ciuic.planner.estimate`).

:func:`plan` is the same from a LightningCLI config (what ``lightning-ciuic plan`` runs), or from a module and a
``HybridParallelStrategy`` given in Python; :func:`search_layouts` plans the other layouts of the world size and
ranks them (:mod:`~lightning_ciuic.planner.search`). No Lightning imports at import time (the config loader has them).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.planner.estimate import Hardware
from lightning_ciuic.planner.layout import (
    ModuleFactory, OptimizerFactory, StageLayout, build_stage, fake_world, imbalance, stage_representatives,
)
from lightning_ciuic.planner.report import GiB, Plan, RankClass

__all__ = ["GiB", "Hardware", "Plan", "RankClass", "plan", "plan_layout", "search_layouts"]


def plan_layout(
    build: ModuleFactory, parallelism: ParallelismConfig, world_size: int, *, optimizers: OptimizerFactory,
    device_memory: int = 80 * GiB, step: Optional[Any] = None, hardware: Optional[Hardware] = None, processes: int = 1,
) -> Plan:
    """Plan ``parallelism`` over ``world_size`` ranks for the module ``build(mesh)`` makes on the meta device;
    ``optimizers(module)`` gives the optimizers the module trains with (see the module docstring). ``step``: a
    :class:`~lightning_ciuic.planner.step.StepSpec` to run the step phase too, its pipeline stages stepped
    ``processes`` at a time; ``hardware``: to estimate its time."""
    dims = parallelism.resolve(world_size)  # the layout's errors, as fit raises them
    layouts: list[StageLayout] = []
    for rank in stage_representatives(dims):
        with fake_world(rank, world_size):
            layouts.append(build_stage(rank, dims, parallelism, build, optimizers))
    seen: dict[str, int] = {}
    for layout in layouts:
        for spec in layout.tensors:
            seen.setdefault(spec.name, math.prod(spec.global_shape))
    classes = []
    for layout in layouts:
        grouped: dict[tuple[int, ...], list[int]] = {}
        for rank in layout.ranks:
            grouped.setdefault(layout.figures(rank).key(), []).append(rank)
        for ranks in grouped.values():
            classes.append(RankClass(ranks, layout.stage, layout.figures(ranks[0]), gathered_unit=layout.largest_unit[1]))
    result = Plan(
        world_size, dims, sum(seen.values()), classes, device_memory,
        largest_units={l.stage: l.largest_unit for l in layouts if l.largest_unit[1]}, hardware=hardware,
        num_microbatches=parallelism.pipeline.num_microbatches, pipeline_schedule=parallelism.pipeline.schedule,
        stages_per_rank=parallelism.pipeline.local_stages, expert_overlap=parallelism.expert_dispatch_overlap,
        max_deferred_weight_backwards=parallelism.pipeline.max_deferred_weight_backwards,
    )
    warning = imbalance(layouts)
    if warning:
        result.warnings.append(warning)
    if step is not None:
        from lightning_ciuic.planner.step import run_step_phase

        run_step_phase(
            result, build, parallelism, optimizers, step, structures=[l.structure() for l in layouts], processes=processes,
        )
    return result



def plan(
    config: Optional[str] = None, *, world_size: int, cli_args: Sequence[str] = (), device_memory: int = 80 * GiB,
    step: Optional[Any] = None, hardware: Optional[Hardware] = None, processes: int = 1, devices_per_node: int = 8,
) -> Plan:
    """Plan the run a LightningCLI config describes (``config``: a YAML path; ``cli_args``: overrides as
    ``lightning-ciuic fit`` takes them) over ``world_size`` ranks: :func:`plan_layout` on its module, its strategy's
    layout and its precision."""
    from lightning_ciuic.planner.config import from_config, module_factory, optimizers_of

    run = from_config(config, cli_args)
    return plan_layout(  # the ep ranks' nodes: the devices per node, as the strategy takes its cluster environment's
        module_factory(run), run.parallelism.with_devices_per_node(devices_per_node), world_size, optimizers=optimizers_of, device_memory=device_memory,
        step=step, hardware=hardware, processes=processes,
    )


def search_layouts(
    config: Optional[str] = None, *, world_size: int, cli_args: Sequence[str] = (), devices_per_node: int = 8,
    device_memory: int = 80 * GiB, step: Optional[Any] = None, hardware: Optional[Hardware] = None, processes: int = 1,
) -> list[Any]:
    """The layouts of ``world_size`` ranks for the run a config describes, planned and ranked best first
    (:func:`~lightning_ciuic.planner.search.search`: a list of ``Candidate``)."""
    from lightning_ciuic.planner.config import from_config, module_factory, optimizers_of
    from lightning_ciuic.planner.search import search

    run = from_config(config, cli_args)
    return search(
        module_factory(run), run.parallelism.with_devices_per_node(devices_per_node), world_size, optimizers=optimizers_of, devices_per_node=devices_per_node,
        step=step, device_memory=device_memory, hardware=hardware, processes=processes,
    )
