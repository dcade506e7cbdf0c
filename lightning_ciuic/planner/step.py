"""The step phase of a plan: activations and peak memory from whole training steps on fake tensors.

Contract: :func:`run_step_phase` builds, for one rank of each pipeline stage, the module exactly as the static phase
does (``parallelize`` on torch's fake process group), then, under ``FakeTensorMode`` (shapes and dtypes, no values,
no memory), allocates it, sets up the data-parallel engine the strategy would run, and runs :func:`train_steps`: one
training step (forward, backward, the engine's gradient synchronization, the optimizer step) on a micro-batch of
``micro_batch_size x sequence_length`` tokens, tracked by torch's ``MemTracker``, after a warm-up that makes the
optimizer's and the engine's state as a first step would (their step on zero gradients, no forward or backward). That
step's peak is the rank's peak; its activations are the peak less the model states
(:func:`held_bytes`: everything else alive at the peak, the batch and temporaries included). Every class of ranks of
the stage gets the stage's activations on top of its own model states. transformers' masks take the path of an
unpacked batch, as for real tensors (:func:`~lightning_ciuic.compat.hugging_face_sequences_unpacked`), and attention
of a value head dim of its own is held as CUDA's memory-efficient kernel holds it
(:func:`~lightning_ciuic.compat.attention_held_as_cuda_holds_it`; the CPU's math path keeps the ``L x S`` weights).
The step's FLOPs (torch's FLOP formulas on each op's local tensors, :mod:`~lightning_ciuic.planner.flops`: the step's
and its forward's) and collective bytes (:mod:`~lightning_ciuic.planner.traffic`) are the stage's, for the step-time
estimate (:mod:`~lightning_ciuic.planner.estimate`).

Pipeline stages (``pp > 1``): each step is the layout's own schedule (torch's, through the strategy's
:class:`~lightning_ciuic.parallel.pipeline.PipelineRunner`) over ``num_microbatches`` micro-batches of that size, in
the schedule's action order, so the micro-batches in flight at the peak are the schedule's. A fake process group
delivers nothing, so the stages are given what a real run's exchange on its first step: each stage's input and output
(:func:`stage_boundaries`, stage by stage from a fake forward of the previous one's output, found once per
configuration and shared by the stages: :class:`StageBoundaries`); and a stage's sends keep
their tensors until the schedule waits for them, as a real process group's do
(:func:`~lightning_ciuic.compat.pipeline_sends_held`). Point-to-point sends are counted with the collectives (axis
``pp``).

Alike stages are not all stepped: under a schedule of one stage per rank (GPipe, 1F1B) the middle stages that hold
alike parts of the model (:func:`alike_stages`: equal parameters, layer indices aside, equal local figures and equal
inputs and outputs) run the same actions but for the number of micro-batches each holds in flight (1F1B's warm-up:
one more for each stage after it), and each micro-batch in flight holds the same saved tensors. Their activations are
therefore on a line in that number, and their FLOPs and bytes per collective equal: the first and last stage of each
group are stepped and the others put on the line through them, their groups' ranks moved by the stages between
(:func:`run_step_phase`; the tests compare it with stepping every stage, to the byte). DeepSeek-V3's 16 stages over
2048 ranks step 6 stages instead of 16. The stages left after stage 0 are stepped ``processes`` at a time in worker
processes that inherit nothing of the planner's (:mod:`~lightning_ciuic.planner.workers`), each given a
:class:`StageStep`.

A deep model is not stepped whole: when its pipeline blocks (``pipeline_blocks()``) are one ``nn.ModuleList`` of
alike layers (same parameter names, shapes and dtypes) longer than ``2 * EXTRAPOLATION_DEPTH`` per stage, the step
runs with the list cut to ``k = EXTRAPOLATION_DEPTH`` layers per stage and to ``2k`` (under pp, the pipeline split
before every ``k``-th layer), and each figure (activations, FLOPs, bytes per collective) is extended along the line
through the two to the ``L`` layers the rank holds in the layout's own split: ``f(L) = f(k) + (f(2k) - f(k)) (L - k) /
k``. Alike layers add the same saved activations, FLOPs and collectives each, so the line is exact (the tests compare
it with whole steps, pipelined too) from two layers on (with one, FSDP2's prefetch of the next unit finds a unit of
another size); the model states come from the static phase, for all ``L`` layers. A split that leaves a stage no
layer, or puts other blocks between two stages' layers, is stepped whole, as is every model when
``EXTRAPOLATION_DEPTH`` is larger than half the layers per stage, or recomputes every k-th block
(``gradient_checkpointing="full:<k>"``, whose layers are not alike; nor are its stages, all stepped).

:func:`~lightning_ciuic.planner.train_step.train_steps` is the one loop, run on fake tensors here and on real ones by
the test that holds the planner to real runs (:mod:`~lightning_ciuic.planner.train_step`). It drives a :class:`~lightning_ciuic.parallel.pipeline_module.PipelineModule` (``pipelined_loss`` on
``(input_ids, targets)``: the pack's causal LMs and ``HuggingFaceCausalLM``). Mixture-of-experts models step under
expert parallelism, the pack's dispatch routing as if balanced (``ExpertLayout.assume_balanced``: the number of tokens
each expert gets is a value, which fake tensors do not have); with ``expert_parallel_size=1`` their own experts'
forward runs, and they are refused, saying so.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic import compat
from lightning_ciuic.comm.engines import build_engine
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.experts import packed_experts
from lightning_ciuic.parallel.fsdp import materialize
from lightning_ciuic.parallel.parallelize import Parallelized, parallelize
from lightning_ciuic.parallel.pipeline import forwards_in_flight, stage_ids_of_rank
from lightning_ciuic.parallel.pipeline_module import PipelineModule, stage_starts
from lightning_ciuic.planner.layout import ModuleFactory, OptimizerFactory, fake_world, stage_representatives
from lightning_ciuic.planner.report import Plan
from lightning_ciuic.planner.train_step import StepFigures, StepSpec, token_batch, train_steps

Boundary = tuple[torch.Tensor, torch.Tensor]  # a pipeline stage's input and output for one micro-batch (meta tensors)


EXTRAPOLATION_DEPTH = 2


def check_steppable(module: nn.Module, dims: ParallelDims) -> None:
    """Refuse, naming why, what :func:`train_steps` cannot run on fake tensors."""
    if packed_experts(module) and not dims.ep_enabled:
        raise ValueError(
            f"{type(module).__name__} routes tokens to its experts by their values, which fake tensors do not have, and"
            " with expert_parallel_size=1 its experts' own forward runs: the step phase plans mixture-of-experts"
            " models under expert parallelism (expert_parallel_size > 1: the pack's dispatch, planned with balanced"
            " routing), or plan this layout without --micro-batch-size/--sequence-length (the static phase is exact)."
        )
    if not isinstance(module, PipelineModule):
        raise TypeError(
            f"the step phase runs pipelined_loss((input_ids, targets)), the pack's protocol for causal LMs, and"
            f" {type(module).__name__} is not a PipelineModule: plan it without --micro-batch-size/--sequence-length."
        )


def repeated_layers(module: nn.Module) -> Optional[nn.ModuleList]:
    """The ``nn.ModuleList`` holding the module's pipeline blocks when they are alike (see the module docstring)."""
    blocks = getattr(module, "pipeline_blocks", None)
    if blocks is None:
        return None
    parents: dict[str, int] = {}
    for name in blocks():
        parent, _, index = name.rpartition(".")
        if index.isdigit():
            parents[parent] = parents.get(parent, 0) + 1
    if not parents:
        return None
    layers = module.get_submodule(max(parents, key=parents.get))
    if not isinstance(layers, nn.ModuleList):
        return None
    signatures = {tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()) for layer in layers}
    return layers if len(signatures) == 1 else None


@contextlib.contextmanager
def _fake_rank(
    rank: int, world_size: int, build: ModuleFactory, config: ParallelismConfig, depth: Optional[int],
) -> Iterator[tuple[Parallelized, DeviceMesh]]:
    """Inside: ``rank``'s part of the module ``build`` makes (its layer list cut to ``depth`` layers; None: whole),
    parallelized on the fake process group and allocated on fake tensors; yields the ``Parallelized`` and the mesh."""
    dims = config.resolve(world_size)
    with fake_world(rank, world_size):
        meshes = dims.build("cpu")
        mesh = meshes.world
        module = build(mesh)
        check_steppable(module, dims)
        if depth is not None:
            del repeated_layers(module)[depth:]
        parallelized = parallelize(module, meshes, config, materialize=False)
        if parallelized.experts is not None:
            parallelized.experts.assume_balanced = True  # the router's choices are values, which fake tensors lack
        with (
            compat.fake_tensor_mode(allow_non_fake_inputs=True), compat.hugging_face_sequences_unpacked(),
            compat.grouped_mm_on_fake_tensors_in_any_dtype(), compat.attention_held_as_cuda_holds_it(),
        ):
            materialize(module, torch.device("cpu"))
            yield parallelized, mesh


def _measure(
    rank: int, world_size: int, build: ModuleFactory, config: ParallelismConfig, optimizers: OptimizerFactory,
    spec: StepSpec, depth: Optional[int], known: Optional[StageBoundaries] = None,
) -> StepFigures:
    """One rank's fake step on the module ``build`` makes, its layer list cut to ``depth`` layers (None: whole).
    ``known``: the stages' boundaries found so far, filled in here, for the stages to share."""
    boundaries: dict[int, Boundary] = {}
    if config.pipeline_parallel_size > 1:
        boundaries = (StageBoundaries() if known is None else known).of(world_size, build, config, spec, depth)
    with _fake_rank(rank, world_size, build, config, depth) as (parallelized, mesh):
        module, pipeline = parallelized.module, parallelized.pipeline
        if pipeline is not None:
            pipeline.stage_metadata = {stage: boundaries[stage] for stage in pipeline.stage_ids}
            spec = StepSpec(spec.micro_batch_size * pipeline.num_microbatches, spec.sequence_length)
        engine = build_engine(parallelized, config)
        batch = token_batch(module, spec, torch.device("cpu"))
        with compat.pipeline_sends_held():
            memory = train_steps(
                module, engine, optimizers(module), batch, mesh, steps=1, pipeline=pipeline, warm_from_zero_gradients=True,
                loss_parallel=parallelized.loss_parallel,
            )
        if engine is not None:
            engine.close()
    return memory.figures()


def _empty_like(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """An empty tensor of ``tensor``'s shape, strides, dtype and ``requires_grad`` on ``device``."""
    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return empty.requires_grad_(tensor.requires_grad)


def stage_boundaries(
    world_size: int, build: ModuleFactory, config: ParallelismConfig, spec: StepSpec, depth: Optional[int],
) -> dict[int, Boundary]:
    """Each pipeline stage's input and output for one micro-batch, as meta tensors, not fake ones (shape, stride,
    dtype, ``requires_grad``): stage by stage, a fake forward of the stage (on a rank that holds it) of the previous
    one's output, the first's input being ``spec``'s token ids. What a real run's stages exchange on their first
    step."""
    dims = config.resolve(world_size)
    per_stage, local = world_size // dims.pp, config.pipeline.local_stages
    holder = {
        stage: pp_rank * per_stage
        for pp_rank in range(dims.pp) for stage in stage_ids_of_rank(pp_rank, dims.pp, local, config.pipeline.schedule)
    }
    boundaries: dict[int, Boundary] = {}
    previous: Optional[torch.Tensor] = None
    for stage in range(dims.pp * local):
        with _fake_rank(holder[stage], world_size, build, config, depth) as (parallelized, _):
            pipeline = parallelized.pipeline
            assert pipeline is not None
            if previous is None:
                inputs = token_batch(parallelized.module, spec, torch.device("cpu"))[0]
            else:
                inputs = _empty_like(previous, "cpu")
            outputs = pipeline.stage_modules[pipeline.stage_ids.index(stage)](inputs)
            if not isinstance(outputs, torch.Tensor):
                raise TypeError(
                    f"pipeline stage {stage} returns {type(outputs).__name__}; the step phase passes one tensor between"
                    " stages (the PipelineModule protocol): plan it without --micro-batch-size/--sequence-length."
                )
        # made here, out of the fake mode: meta tensors, which pickle (fake ones do not) for the step's workers
        boundaries[stage] = (_empty_like(inputs, "meta"), _empty_like(outputs, "meta"))
        previous = boundaries[stage][1]
    return boundaries


def _layers_name(module: nn.Module) -> str:
    """The name of the module's :func:`repeated_layers` list (the prefix of its layers' block names)."""
    layers = repeated_layers(module)
    return next(name for name, m in module.named_modules() if m is layers)


def _layers_per_rank(module: nn.Module, config: ParallelismConfig, dims: ParallelDims) -> Optional[list[int]]:
    """The repeated layers each pipeline rank holds under the layout's own split; None where a rank holds none, or
    where blocks other than the layers (embedding, head) sit between two stages' layers."""
    names, prefix = list(module.pipeline_blocks()), _layers_name(module)
    is_layer = [name.rpartition(".")[0] == prefix for name in names]
    first, last = is_layer.index(True), len(is_layer) - 1 - is_layer[::-1].index(True)
    local = config.pipeline.local_stages
    starts = stage_starts(module, names, dims.pp * local, config.pipeline) + [len(names)]
    per_stage = [sum(is_layer[a:b]) for a, b in zip(starts, starts[1:])]
    if min(per_stage) == 0 or not all(first < start <= last for start in starts[1:-1]):
        return None
    return [
        sum(per_stage[s] for s in stage_ids_of_rank(r, dims.pp, local, config.pipeline.schedule)) for r in range(dims.pp)
    ]


def _split_every(config: ParallelismConfig, module: nn.Module, depth: int) -> ParallelismConfig:
    """``config`` with its pipeline split before every ``depth``-th layer: each stage ``depth`` layers of the list cut to
    ``stages x depth`` (the blocks before and after the layers staying with the first and last stage)."""
    if config.pipeline_parallel_size == 1:
        return config
    prefix = _layers_name(module)
    stages = config.pipeline_parallel_size * config.pipeline.local_stages
    points = tuple(f"{prefix}.{stage * depth}" for stage in range(1, stages))
    return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, split_points=points))


def step_figures(
    rank: int, world_size: int, build: ModuleFactory, config: ParallelismConfig, optimizers: OptimizerFactory,
    spec: StepSpec, depth: Optional[int] = None, known: Optional[StageBoundaries] = None,
) -> StepFigures:
    """The step's figures for ``rank`` of ``world_size``: measured whole, or extended from ``depth`` (default
    ``EXTRAPOLATION_DEPTH``) and ``2 depth`` layers per stage (see the module docstring). ``known``: the boundaries the
    calls for a layout's stages share, so that its stages' boundaries are computed once (see :func:`_measure`)."""
    depth = EXTRAPOLATION_DEPTH if depth is None else depth
    dims = config.resolve(world_size)
    local = config.pipeline.local_stages if dims.pp_enabled else 1
    with fake_world(rank, world_size):
        module = build(dims.build("cpu").world)
        layers = repeated_layers(module)
        held = None
        if layers is not None and len(layers) > 2 * depth * dims.pp * local and config.gradient_checkpointing.every == 1:
            held = _layers_per_rank(module, config, dims) if dims.pp_enabled else [len(layers)]
    if held is None:
        return _measure(rank, world_size, build, config, optimizers, spec, None, known)
    shallow, deeper = (
        _measure(rank, world_size, build, _split_every(config, module, d), optimizers, spec, d * dims.pp * local, known)
        for d in (depth, 2 * depth)
    )
    return shallow.extended(deeper, depth * local, held[rank // (world_size // dims.pp)])


@dataclass
class StageBoundaries:
    """The pipeline stages' inputs and outputs (:func:`stage_boundaries`) of each configuration stepped, ``(layout,
    depth)`` -> stage -> :data:`Boundary`: found by the first stage stepped and shared by the others (handed to the
    step workers with the :class:`StageStep`), and compared by :func:`alike_stages`."""

    found: dict[tuple[ParallelismConfig, Optional[int]], dict[int, Boundary]] = field(default_factory=dict)

    def of(self, world_size: int, build: ModuleFactory, config: ParallelismConfig, spec: StepSpec, depth: Optional[int]) -> dict[int, Boundary]:
        """The boundaries of ``config`` with its layer list cut to ``depth`` layers, found on first asking."""
        if (config, depth) not in self.found:
            self.found[config, depth] = stage_boundaries(world_size, build, config, spec, depth)
        return self.found[config, depth]

    def signature(self, stage: int) -> tuple:
        """Stage ``stage``'s input and output (shape, stride, dtype, ``requires_grad``) in every configuration."""
        return tuple(
            tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in boundaries[stage])
            for boundaries in self.found.values()
        )


def alike_stages(
    structures: Sequence[tuple], known: StageBoundaries, config: ParallelismConfig, stages: int,
) -> list[list[int]]:
    """Groups of pipeline stages whose ranks step alike but for the micro-batches they hold in flight: stages neither
    first nor last (those take token ids, or compute the loss) of equal :meth:`StageLayout.structure
    <lightning_ciuic.planner.layout.StageLayout.structure>` and equal inputs and outputs in every configuration stepped
    (``known``), under a schedule of one stage per rank, and all with or all without a steady phase (fewer
    forwards in flight than micro-batches). Empty where the schedule places several stages on a rank, or a layer
    stride recomputes every k-th block."""
    pipeline = config.pipeline
    if config.pipeline_parallel_size == 1 or pipeline.local_stages != 1 or config.gradient_checkpointing.every > 1:
        return []  # (a layer stride recomputes other layers on each stage)
    groups: dict[tuple, list[int]] = {}
    for stage in range(1, stages - 1):
        in_flight = forwards_in_flight(pipeline.schedule, stage, stages, pipeline.num_microbatches)
        if in_flight is None:
            return []
        key = (structures[stage], known.signature(stage), in_flight < pipeline.num_microbatches)
        groups.setdefault(key, []).append(stage)
    return list(groups.values())


def _between(low: tuple[int, StepFigures], high: tuple[int, StepFigures], stage: int, config: ParallelismConfig, per_stage: int) -> StepFigures:
    """Stage ``stage``'s figures from two alike stages' (``(stage, figures)``, see :func:`alike_stages`): the same FLOPs
    and bytes per collective, its groups' ranks those of ``low``'s moved by the stages between them (a group spanning
    stages is theirs too), and the activations on the line through the two in forwards in flight."""
    pipeline, stages = config.pipeline, config.pipeline_parallel_size
    (low_stage, low_figures), (high_stage, high_figures) = low, high

    def in_flight(s: int) -> int:
        return forwards_in_flight(pipeline.schedule, s, stages, pipeline.num_microbatches)

    span = in_flight(high_stage) - in_flight(low_stage)
    activations = low_figures.activations + (
        round((high_figures.activations - low_figures.activations) * (in_flight(stage) - in_flight(low_stage)) / span)
        if span else 0
    )
    moved = (stage - low_stage) * per_stage
    axis_ranks = {
        axis: ranks if len({r // per_stage for r in ranks}) > 1 else [r + moved for r in ranks]
        for axis, ranks in low_figures.axis_ranks.items()
    }
    return dataclasses.replace(low_figures, activations=activations, axis_ranks=axis_ranks)


@dataclass
class StageStep:
    """One pipeline stage's step (:func:`step_figures` on the stage's first rank) as a callable that pickles: what a
    worker process of :func:`~lightning_ciuic.planner.workers.step_stages` is given, and all it is given.
    ``known`` is filled in by the first stage stepped (see :func:`_measure`); ``depth`` is fixed here, in
    the planner's process (a worker reads nothing of it, ``EXTRAPOLATION_DEPTH`` included)."""

    representatives: list[int]  # each stage's first rank
    world_size: int
    build: ModuleFactory
    config: ParallelismConfig
    optimizers: OptimizerFactory
    spec: StepSpec
    depth: int
    known: StageBoundaries = field(default_factory=StageBoundaries)

    def rank(self, stage: int) -> int:
        return self.representatives[stage]

    def __call__(self, stage: int) -> StepFigures:
        return step_figures(
            self.rank(stage), self.world_size, self.build, self.config, self.optimizers, self.spec, depth=self.depth,
            known=self.known,
        )


def run_step_phase(
    plan: Plan, build: ModuleFactory, config: ParallelismConfig, optimizers: OptimizerFactory, spec: StepSpec,
    structures: Optional[Sequence[tuple]] = None, processes: int = 1,
) -> None:
    """Fill in each rank class's activations and peak, and each pipeline stage's step figures (see the module
    docstring). ``structures``: each stage's ``StageLayout.structure()``, to step only the first and last of alike
    stages (:func:`alike_stages`); without it every stage is stepped. ``processes``: how many stages to step at once,
    in worker processes that inherit nothing of this one (:mod:`~lightning_ciuic.planner.workers`; the first stage is
    stepped first, here: it finds every stage's inputs and outputs)."""
    from lightning_ciuic.planner.workers import step_stages

    representatives = stage_representatives(config.resolve(plan.world_size))
    per_stage, stages = plan.world_size // len(representatives), len(representatives)
    step = StageStep(list(representatives), plan.world_size, build, config, optimizers, spec, EXTRAPOLATION_DEPTH)
    figures = {0: step(0)}  # fills step.known with every configuration the stages step
    groups = alike_stages(structures, step.known, config, stages) if structures is not None else []
    between = {stage: group for group in groups if len(group) > 2 for stage in group[1:-1]}
    figures.update(step_stages([s for s in range(1, stages) if s not in between], step, processes))
    for stage, group in between.items():
        figures[stage] = _between((group[0], figures[group[0]]), (group[-1], figures[group[-1]]), stage, config, per_stage)
    for stage in range(stages):
        for rank_class in plan.classes:
            if rank_class.pp_stage == stage:
                rank_class.activations = figures[stage].activations
                rank_class.peak = rank_class.model_states + figures[stage].activations
        plan.steps[stage] = figures[stage]
