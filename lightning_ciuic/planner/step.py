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
(:func:`stage_boundaries`, stage by stage from a fake forward of the previous one's output); and a stage's sends keep
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

:func:`train_steps` is the one loop, run on fake tensors here and on real ones by the test that holds the planner to
real runs. It drives a :class:`~lightning_ciuic.parallel.pipeline_module.PipelineModule` (``pipelined_loss`` on
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
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_ciuic import compat
from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.experts import packed_experts
from lightning_ciuic.parallel.fsdp import materialize
from lightning_ciuic.parallel.parallelize import parallelize
from lightning_ciuic.parallel.pipeline import PipelineRunner, forwards_in_flight, stage_ids_of_rank
from lightning_ciuic.parallel.pipeline_module import PipelineModule, stage_starts
from lightning_ciuic.planner.flops import LocalFlops
from lightning_ciuic.planner.layout import ModuleFactory, OptimizerFactory, data_parallel_engine, fake_world, stage_representatives
from lightning_ciuic.planner.traffic import CollectiveTraffic
from lightning_ciuic.strategies.redirection import through_root
from lightning_ciuic.tensors import local_tensor


@dataclass(frozen=True)
class StepSpec:
    """The micro-batch a step phase runs: ``micro_batch_size`` sequences of ``sequence_length`` tokens."""

    micro_batch_size: int
    sequence_length: int

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "sequence_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")


EXTRAPOLATION_DEPTH = 2


@dataclass(frozen=True)
class StepFigures:
    """What a plan takes from a step: bytes, FLOPs and the collectives' bytes and groups."""

    activations: int  # the peak less the model states
    traffic: dict[str, dict[str, int]]  # mesh axis -> collective -> bytes this rank sent in the step
    axis_ranks: dict[str, list[int]]  # mesh axis -> the global ranks of this rank's group on it
    flops: int  # recomputed forwards included
    forward_flops: int

    def extended(self, deeper: "StepFigures", depth: int, layers: int) -> "StepFigures":
        """The figures at ``layers`` layers, on the line through ``self`` (``depth`` layers) and ``deeper`` (2x)."""

        def line(a: int, b: int) -> int:
            return a + round((b - a) * (layers - depth) / depth)

        axes = set(self.traffic) | set(deeper.traffic)
        traffic = {
            axis: {
                name: line(self.traffic.get(axis, {}).get(name, 0), deeper.traffic.get(axis, {}).get(name, 0))
                for name in set(self.traffic.get(axis, {})) | set(deeper.traffic.get(axis, {}))
            }
            for axis in axes
        }
        return StepFigures(
            line(self.activations, deeper.activations), traffic, {**self.axis_ranks, **deeper.axis_ranks},
            line(self.flops, deeper.flops), line(self.forward_flops, deeper.forward_flops),
        )


@dataclass(frozen=True)
class StepMemory:
    """What :func:`train_steps` measured on one rank (bytes)."""

    peak: int
    model_states: int  # parameters, gradients, optimizer state and engine buffers held after the step (held_bytes)
    traffic: dict[str, dict[str, int]]  # mesh axis -> collective -> bytes this rank sent in the last step
    axis_ranks: dict[str, list[int]]  # mesh axis -> the global ranks of this rank's group on it
    flops: int  # counted in the last step (recomputed forwards included)
    forward_flops: int  # counted in its forward

    @property
    def activations(self) -> int:
        return self.peak - self.model_states

    def figures(self) -> StepFigures:
        return StepFigures(self.activations, self.traffic, self.axis_ranks, self.flops, self.forward_flops)


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


def token_batch(module: nn.Module, spec: StepSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)`` of ``spec``'s shape, within the vocabulary of the module's first embedding."""
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    vocabulary = embedding.num_embeddings if embedding is not None else 2
    shape = (spec.micro_batch_size, spec.sequence_length)
    return torch.randint(0, vocabulary, shape, device=device), torch.randint(0, vocabulary, shape, device=device)


def train_steps(
    module: nn.Module, engine: Optional[DataParallel], optimizers: Sequence[torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor], mesh: Any = None, steps: int = 2, pipeline: Optional[PipelineRunner] = None,
    warm_from_zero_gradients: bool = False,
) -> StepMemory:
    """``steps`` training steps tracked by ``MemTracker``; the last step's peak, FLOPs and collective bytes
    (:class:`~lightning_ciuic.planner.traffic.CollectiveTraffic`; ``mesh``: the layout's, to name its axes), and the
    model states after it. With ``pipeline`` (this rank's stages), each step is its schedule over the whole ``batch``
    (forward and backward of every micro-batch, in the schedule's order); MemTracker then keeps totals only
    (:func:`~lightning_ciuic.compat.memory_tracker` without per-module statistics: a schedule calls each stage once per
    micro-batch).

    The last step is measured warm: the optimizer's state and the engine's made by the steps before it, or, with
    ``warm_from_zero_gradients``, before the first step by what a step ends with, on zero gradients and without a
    forward or backward (the engine's synchronization of the gradients, the optimizer's step, the gradients cleared):
    the step phase's warm-up, a whole schedule cheaper (the tests hold its figures to real runs warmed by a step)."""
    tracker = compat.memory_tracker(per_module=pipeline is None)
    tracker.track_external(module, *optimizers)
    device = batch[0].device
    step_module = _Step(module)
    traffic, flops = CollectiveTraffic(mesh), LocalFlops()
    with tracker:
        if warm_from_zero_gradients:
            _warm_on_zero_gradients(module, engine, optimizers)
        for step in range(steps):
            last = step == steps - 1
            if last:
                tracker.reset_mod_stats()
            with traffic if last else contextlib.nullcontext(), flops if last else contextlib.nullcontext():
                if pipeline is None:
                    step_module(batch).backward()
                else:
                    pipeline.run(*batch, train=True)
                _end_step(engine, optimizers)
            if not last:
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
        peak = _total(tracker.get_tracker_snapshot("peak"), device)
    held = sum(v for k, v in held_bytes(module, engine, optimizers).items() if k != "parameters")
    return StepMemory(
        peak, held, {axis: dict(by) for axis, by in traffic.bytes.items()}, dict(traffic.ranks),
        flops=flops.total, forward_flops=flops.forward,
    )


def _end_step(engine: Optional[DataParallel], optimizers: Sequence[torch.optim.Optimizer], accumulated: bool = False) -> None:
    """What follows a step's backward: the engine's gradient synchronization, the optimizers' step."""
    if engine is not None:
        engine.after_backward(accumulated)
    for optimizer in optimizers:
        optimizer.step()


def _warm_on_zero_gradients(module: nn.Module, engine: Optional[DataParallel], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """The end of a step on zero gradients, each in its parameter's placements: the optimizers' and the engine's
    state made as a step makes them (the engine takes the gradients as accumulated ones, present without its
    backward hooks)."""
    trained = [p for p in module.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.zeros_like(p)
    _end_step(engine, optimizers, accumulated=True)
    for p in trained:
        p.grad = None


class _Step(nn.Module):
    """One training step's loss as a module call: ``MemTracker`` takes a second call of its root module for the next
    step, and an FSDP2 root is called twice in a step (its step routed through its forward, then ``self(x)``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if isinstance(self.module, FSDPModule):
            return through_root(self.module, "pipelined_loss", batch)
        return self.module.pipelined_loss(batch)


def held_bytes(module: nn.Module, engine: Optional[DataParallel], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, int]:
    """What a rank holds between steps, counted on its own tensors (local shards): the static phase's figures."""

    def nbytes(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()

    params = list(module.parameters())
    states = [v for o in optimizers for state in o.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": sum(local_tensor(p).numel() for p in params),
        "parameter_bytes": sum(nbytes(p) for p in params),
        "gradient_bytes": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(nbytes(t) for t in states),
        "buffer_bytes": engine.buffer_bytes() if engine is not None else 0,
    }


def _total(snapshot: dict[Any, dict[Any, int]], device: torch.device) -> int:
    per_device = snapshot.get(device) or next(iter(snapshot.values()), {})
    return int(per_device.get("Total", 0))


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
def _fake_rank(rank: int, plan: Any, build: ModuleFactory, config: ParallelismConfig, depth: Optional[int]) -> Iterator[Any]:
    """Inside: ``rank``'s part of the module ``build`` makes (its layer list cut to ``depth`` layers; None: whole),
    parallelized on the fake process group and allocated on fake tensors; yields the ``Parallelized`` and the mesh."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dims = config.resolve(plan.world_size)
    with fake_world(rank, plan.world_size):
        mesh = dims.build_mesh("cpu")
        module = build(mesh)
        check_steppable(module, dims)
        if depth is not None:
            del repeated_layers(module)[depth:]
        parallelized = parallelize(module, dims, config, mesh=mesh, materialize=False)
        if parallelized.experts is not None:
            parallelized.experts.assume_balanced = True  # the router's choices are values, which fake tensors lack
        with (
            FakeTensorMode(allow_non_fake_inputs=True), compat.hugging_face_sequences_unpacked(),
            compat.grouped_mm_on_fake_tensors_in_any_dtype(), compat.attention_held_as_cuda_holds_it(),
        ):
            materialize(module, torch.device("cpu"))
            yield parallelized, mesh


def _measure(
    rank: int, plan: Any, build: ModuleFactory, config: ParallelismConfig, optimizers: OptimizerFactory,
    spec: StepSpec, depth: Optional[int], known_boundaries: Optional[dict] = None,
) -> StepFigures:
    """One rank's fake step on the module ``build`` makes, its layer list cut to ``depth`` layers (None: whole).
    ``known_boundaries``: :func:`stage_boundaries` by ``(config, depth)``, filled in here, for the stages to share."""
    boundaries = None
    if config.pipeline_parallel_size > 1:
        known = {} if known_boundaries is None else known_boundaries
        if (config, depth) not in known:
            known[config, depth] = stage_boundaries(plan, build, config, spec, depth)
        boundaries = known[config, depth]
    with _fake_rank(rank, plan, build, config, depth) as (parallelized, mesh):
        module, pipeline = parallelized.module, parallelized.pipeline
        if pipeline is not None:
            pipeline.stage_metadata = {stage: boundaries[stage] for stage in pipeline.stage_ids}
            spec = StepSpec(spec.micro_batch_size * pipeline.num_microbatches, spec.sequence_length)
        engine = data_parallel_engine(parallelized, config)
        batch = token_batch(module, spec, torch.device("cpu"))
        with compat.pipeline_sends_held():
            memory = train_steps(
                module, engine, optimizers(module), batch, mesh, steps=1, pipeline=pipeline, warm_from_zero_gradients=True,
            )
        if engine is not None:
            engine.close()
    return memory.figures()


def _empty_like(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """An empty tensor of ``tensor``'s shape, strides, dtype and ``requires_grad`` on ``device``."""
    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return empty.requires_grad_(tensor.requires_grad)


def stage_boundaries(
    plan: Any, build: ModuleFactory, config: ParallelismConfig, spec: StepSpec, depth: Optional[int],
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each pipeline stage's input and output for one micro-batch, as meta tensors, not fake ones (shape, stride,
    dtype, ``requires_grad``): stage by stage, a fake forward of the stage (on a rank that holds it) of the previous
    one's output, the first's input being ``spec``'s token ids. What a real run's stages exchange on their first
    step."""
    dims = config.resolve(plan.world_size)
    per_stage, local = plan.world_size // dims.pp, config.pipeline.local_stages
    holder = {
        stage: pp_rank * per_stage
        for pp_rank in range(dims.pp) for stage in stage_ids_of_rank(pp_rank, dims.pp, local, config.pipeline.schedule)
    }
    boundaries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    previous: Optional[torch.Tensor] = None
    for stage in range(dims.pp * local):
        with _fake_rank(holder[stage], plan, build, config, depth) as (parallelized, _):
            pipeline = parallelized.pipeline
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
    rank: int, plan: Any, build: ModuleFactory, config: ParallelismConfig, optimizers: OptimizerFactory,
    spec: StepSpec, depth: Optional[int] = None, known_boundaries: Optional[dict] = None,
) -> StepFigures:
    """The step's figures for ``rank``: measured whole, or extended from ``depth`` (default ``EXTRAPOLATION_DEPTH``)
    and ``2 depth`` layers per stage (see the module docstring). ``known_boundaries``: a dict the calls for a layout's
    stages share, so that its stages' boundaries are computed once (see :func:`_measure`)."""
    depth = EXTRAPOLATION_DEPTH if depth is None else depth
    dims = config.resolve(plan.world_size)
    local = config.pipeline.local_stages if dims.pp_enabled else 1
    with fake_world(rank, plan.world_size):
        module = build(dims.build_mesh("cpu"))
        layers = repeated_layers(module)
        held = None
        if layers is not None and len(layers) > 2 * depth * dims.pp * local and config.gradient_checkpointing.every == 1:
            held = _layers_per_rank(module, config, dims) if dims.pp_enabled else [len(layers)]
    if held is None:
        return _measure(rank, plan, build, config, optimizers, spec, None, known_boundaries)
    shallow, deeper = (
        _measure(rank, plan, build, _split_every(config, module, d), optimizers, spec, d * dims.pp * local, known_boundaries)
        for d in (depth, 2 * depth)
    )
    return shallow.extended(deeper, depth * local, held[rank // (plan.world_size // dims.pp)])


def _boundary_signature(stage: int, known_boundaries: dict) -> tuple:
    """Stage ``stage``'s input and output (shape, stride, dtype, ``requires_grad``) in every configuration stepped."""
    return tuple(
        tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad) for t in boundaries[stage])
        for boundaries in known_boundaries.values()
    )


def alike_stages(
    structures: Sequence[tuple], known_boundaries: dict, config: ParallelismConfig, stages: int,
) -> list[list[int]]:
    """Groups of pipeline stages whose ranks step alike but for the micro-batches they hold in flight: stages neither
    first nor last (those take token ids, or compute the loss) of equal :meth:`StageLayout.structure
    <lightning_ciuic.planner.layout.StageLayout.structure>` and equal inputs and outputs in every configuration stepped
    (``known_boundaries``), under a schedule of one stage per rank, and all with or all without a steady phase (fewer
    forwards in flight than micro-batches). Empty where the schedule places several stages on a rank, or a layer stride
recomputes every k-th block."""
    pipeline = config.pipeline
    if config.pipeline_parallel_size == 1 or pipeline.local_stages != 1 or config.gradient_checkpointing.every > 1:
        return []  # (a layer stride recomputes other layers on each stage)
    groups: dict[tuple, list[int]] = {}
    for stage in range(1, stages - 1):
        in_flight = forwards_in_flight(pipeline.schedule, stage, stages, pipeline.num_microbatches)
        if in_flight is None:
            return []
        key = (structures[stage], _boundary_signature(stage, known_boundaries), in_flight < pipeline.num_microbatches)
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
    ``known_boundaries`` is filled in by the first stage stepped (see :func:`_measure`); ``depth`` is fixed here, in
    the planner's process (a worker reads nothing of it, ``EXTRAPOLATION_DEPTH`` included)."""

    representatives: list[int]  # each stage's first rank
    world_size: int
    build: ModuleFactory
    config: ParallelismConfig
    optimizers: OptimizerFactory
    spec: StepSpec
    depth: int
    known_boundaries: dict = dataclasses.field(default_factory=dict)

    def rank(self, stage: int) -> int:
        return self.representatives[stage]

    def __call__(self, stage: int) -> StepFigures:
        return step_figures(
            self.rank(stage), _World(self.world_size), self.build, self.config, self.optimizers, self.spec,
            depth=self.depth, known_boundaries=self.known_boundaries,
        )


@dataclass(frozen=True)
class _World:
    """What :func:`step_figures` reads of a plan: its world size."""

    world_size: int


def run_step_phase(
    plan: Any, build: ModuleFactory, config: ParallelismConfig, optimizers: OptimizerFactory, spec: StepSpec,
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
    figures = {0: step(0)}  # fills step.known_boundaries with every configuration the stages step
    groups = alike_stages(structures, step.known_boundaries, config, stages) if structures is not None else []
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
