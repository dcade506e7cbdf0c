"""Pipeline parallelism: stage splitting, schedule construction and execution over ``torch.distributed.pipelining``.

Contract:

* A model is pipelined through an ordered list of *blocks*: names of sub-modules of a root module (for a
  LightningModule, e.g. ``["model.embed", "model.layers.0", ..., "model.head"]``) whose forwards, applied in
  order to one tensor, compute the model's output. A block whose forward needs more than that tensor (a
  Hugging Face decoder layer wants position embeddings) gets a *call*, ``call(block, x) -> y``. Every
  trainable parameter of the root must belong to exactly one block.
* :func:`balanced_split` cuts the blocks into contiguous stages minimizing the largest stage's sum of their sizes
  (the parameters a token passes: :func:`~lightning_ciuic.parallel.experts.parameters_per_token`);
  :func:`split_at` cuts them before explicitly named blocks instead.
* :func:`partition` keeps this rank's stages and replaces every other block *in place* by an
  :class:`OnAnotherStage` placeholder. The root therefore keeps the parameter names (FQNs) of the unsplit
  model, so its ``state_dict`` and a ``torch.distributed.checkpoint`` checkpoint are portable across
  pipeline sizes.
* :class:`PipelineRunner` runs one of torch's schedules (GPipe, 1F1B, interleaved 1F1B, looped BFS, the
  zero-bubble schedules, DualPipeV) over those stages. ``run(inputs, targets, train=True)`` does forward
  *and* backward of all micro-batches (``num_microbatches`` must divide the batch; evaluation batches it does
  not divide run with the largest number of equal micro-batches below it), leaving gradients accumulated in
  ``.grad`` (scaled so that they equal the gradient of the mean micro-batch loss divided by ``loss_divisor``)
  and returns the mean loss, identical on every rank of the pipeline group; every DTensor gradient is then in its
  parameter's placements, whatever the schedule (the zero-bubble schedules' split weight backward runs no gradient
  hook). Under sequence parallelism (``sequence_shards``: tp) the stages exchange each tp rank's part of the sequence,
  which must be of equal length: inputs whose sequence tp does not divide are refused. ``train=False`` runs forward
  only. A schedule is built per (mode, batch shape), because stages size their receive buffers from the
  first batch they see. Where ``stage_metadata`` gives each of this rank's stages an example input and output (a
  meta tensor of each one's shape, stride, dtype and ``requires_grad``: what the planner runs on a fake process group,
  where nothing a stage sends arrives), the stages take them instead of exchanging shapes and a vote with their
  neighbours on the first step (torch's STATIC inference mode).
* ``overlap_pairs`` (the strategy sets it with ``expert_dispatch_overlap``): DualPipeV's forward-backward pairs
  (``OVERLAP_F_B``) run interleaved, one micro-batch's expert all-to-alls in flight while the other computes
  (:mod:`~lightning_ciuic.parallel.paired_overlap`), not one after the other; the same gradients.
* The runner times each stage's compute and reports ``bubble``: the fraction of the step this rank spent not computing
  (waiting for its neighbours), to compare with :func:`~lightning_ciuic.parallel.schedule_bubble.schedule_bubble`. The
  compute chunks and the gaps between them (sends, receives, waits) go to :data:`lightning_ciuic.timeline.timeline`.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_ciuic import compat
from lightning_ciuic.timeline import timeline
from lightning_ciuic.validation import check_int
from lightning_ciuic.parallel import paired_overlap, weight_backlog
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.fsdp import holds_gradients
from lightning_ciuic.parallel.pipeline_sends import SendRelease
from lightning_ciuic.parallel.split_backward import BackwardPasses
from lightning_ciuic.parallel.tensor import gradient_to_parameter_placements, local_loss

PipelineScheduleName = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
]


@dataclass(frozen=True)
class _ScheduleKind:
    cls_name: str
    placement: Literal["single", "loop", "v"]  # one stage per rank; virtual stages looped or V-shaped
    split_backward: bool = False  # input and weight backwards apart (the weight's deferred: weight_backlog)


SCHEDULES: dict[str, _ScheduleKind] = {
    "gpipe": _ScheduleKind("ScheduleGPipe", "single"),
    "1f1b": _ScheduleKind("Schedule1F1B", "single"),
    "interleaved_1f1b": _ScheduleKind("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": _ScheduleKind("ScheduleLoopedBFS", "loop"),
    "interleaved_zero_bubble": _ScheduleKind("ScheduleInterleavedZeroBubble", "loop", split_backward=True),
    "zbv_zero_bubble": _ScheduleKind("ScheduleZBVZeroBubble", "v", split_backward=True),
    "dualpipev": _ScheduleKind("ScheduleDualPipeV", "v", split_backward=True),
}
SPLIT_BACKWARD_SCHEDULES = tuple(name for name, kind in SCHEDULES.items() if kind.split_backward)


def resolve_stages_per_rank(schedule: str, stages_per_rank: Optional[int]) -> int:
    """Validate ``schedule`` and its virtual stages per rank; returns the number of stages each rank holds."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not one of {sorted(SCHEDULES)}.")
    placement = SCHEDULES[schedule].placement
    check_int("stages_per_rank", stages_per_rank, allowed=(None,))
    if placement == "single":
        if stages_per_rank not in (None, 1):
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs one stage per rank, but stages_per_rank={stages_per_rank};"
                " use stages_per_rank=1 (or None), or an interleaved schedule such as 'interleaved_1f1b'."
            )
        return 1
    if placement == "v":
        if stages_per_rank not in (None, 2):
            raise ValueError(
                f"pipeline_schedule={schedule!r} places exactly 2 stages per rank in a V; got stages_per_rank="
                f"{stages_per_rank}. Use stages_per_rank=2 (or None)."
            )
        return 2
    if stages_per_rank is None or stages_per_rank < 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} interleaves several virtual stages per rank; set stages_per_rank >= 2"
            f" (got {stages_per_rank!r}), or use 'gpipe' / '1f1b' for one stage per rank."
        )
    return stages_per_rank


def stage_ids_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The global stage indices pipeline rank ``pp_rank`` holds: looped (``r, r+p, ...``) or V-shaped."""
    if SCHEDULES[schedule].placement == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def forwards_in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> Optional[int]:
    """The most micro-batches whose forward ``stage`` has run and whose backward it has not yet, under a schedule of
    one stage per rank: GPipe all of them, 1F1B its warm-up (one for itself and one for each stage after it, at most
    all); ``None`` under the multi-stage schedules, whose stages' orders differ by more than one count."""
    return {"gpipe": microbatches, "1f1b": min(microbatches, stages - stage)}.get(schedule)


PIPELINE_COMPUTE = "pp_compute"  # timeline category of a stage's forward / backward chunk


def _record_waits(start: float, end: float) -> None:
    """On the timeline's ``pp collectives`` track: the gaps of the schedule's step between this rank's compute chunks,
    where it sent, received and waited for its neighbours (the bubble)."""
    chunks = [s for s in timeline.ending_within(start, end) if s.category == PIPELINE_COMPUTE]
    edge = start
    for chunk in chunks:
        if chunk.start > edge:
            timeline.record("pp send / receive / wait", Axis.PP, edge, chunk.start, track="pp collectives")
        edge = max(edge, chunk.end)
    if end > edge:
        timeline.record("pp send / receive / wait", Axis.PP, edge, end, track="pp collectives")


def balanced_split(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Start index of each of ``num_stages`` contiguous, non-empty groups of ``sizes`` minimizing the largest sum."""
    n = len(sizes)
    if num_stages > n:
        raise ValueError(
            f"cannot cut {n} pipeline blocks into {num_stages} stages: each stage needs at least one block."
        )
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: smallest possible largest group when the first i blocks form k groups; cut[k][i]: start of the k-th
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, end = [], n
    for k in range(num_stages, 0, -1):
        end = cut[k][end]
        starts.append(end)
    return starts[::-1]


def split_at(block_names: Sequence[str], split_points: Sequence[str], num_stages: int) -> list[int]:
    """Start index of each stage when stages begin at the blocks named in ``split_points``."""
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"{len(split_points)} pipeline split points give {len(split_points) + 1} stages, but pipeline_parallel_size"
            f" x stages_per_rank = {num_stages} stages are needed; give {num_stages - 1} block names."
        )
    starts = [0]
    for name in split_points:
        if name not in block_names:
            raise ValueError(f"pipeline split point {name!r} is not a pipeline block; blocks are {list(block_names)}.")
        starts.append(list(block_names).index(name))
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"pipeline split points {list(split_points)} must name distinct blocks in order, after the first block."
        )
    return starts


class OnAnotherStage(nn.Module):
    """Stands in for a block that lives on another pipeline stage; calling it is an error that says so. It keeps the
    names of the block's persistent buffers (``buffer_names``, relative to it), which a single-file checkpoint lists
    among the tensors: :func:`persistent_buffer_names` tells them from the parameters."""

    def __init__(self, name: str, stage: int, buffer_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.block_name, self.stage, self.buffer_names = name, stage, tuple(buffer_names)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.block_name!r} runs on pipeline stage {self.stage}, not on this rank: under pipeline parallelism"
            " the model is run by the pipeline schedule (PipelineModule.pipelined_loss / pipelined_forward),"
            " not called directly."
        )

    def extra_repr(self) -> str:
        return f"{self.block_name!r} on stage {self.stage}"


def persistent_buffer_names(module: nn.Module) -> set[str]:
    """The names under which ``module.state_dict()`` holds buffers, those of blocks on other stages included."""
    params = {name for name, _ in module.named_parameters()}
    names = {name for name in module.state_dict(keep_vars=True) if name not in params}
    for prefix, sub in module.named_modules():
        if isinstance(sub, OnAnotherStage):
            names.update(f"{prefix}.{name}" for name in sub.buffer_names)
    return names


BlockCall = Callable[[nn.Module, Any], Any]


class StageModule(nn.Module):
    """One pipeline stage: its blocks applied in order (through their call, where one is given)."""

    def __init__(self, blocks: Sequence[nn.Module], calls: Optional[Sequence[Optional[BlockCall]]] = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.calls = list(calls) if calls is not None else [None] * len(blocks)

    def forward(self, x: Any) -> Any:
        for block, call in zip(self.blocks, self.calls):
            x = block(x) if call is None else call(block, x)
        return x


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent.register_module(child, module)


def block_modules(root: nn.Module, block_names: Sequence[str]) -> list[nn.Module]:
    """The blocks named ``block_names``; raises if a name is missing, repeated, or a parameter is in no block."""
    if not block_names:
        raise ValueError("pipeline_blocks() returned no blocks; list the sub-modules that run in order.")
    if len(set(block_names)) != len(block_names):
        raise ValueError(f"pipeline blocks must be distinct, got {list(block_names)}.")
    names = dict(root.named_modules())
    missing = [name for name in block_names if name not in names]
    if missing:
        raise ValueError(
            f"pipeline blocks {missing} are not sub-modules of {type(root).__name__};"
            f" sub-module names look like {[n for n in names if n][:6]}."
        )
    blocks = [names[name] for name in block_names]
    owner: dict[int, str] = {}
    for name, block in zip(block_names, blocks):
        for param in block.parameters():
            if id(param) in owner and owner[id(param)] != name:
                raise ValueError(
                    f"a parameter is shared by pipeline blocks {owner[id(param)]!r} and {name!r} (tied weights);"
                    " a parameter must belong to exactly one block."
                )
            owner[id(param)] = name
    orphans = [name for name, p in root.named_parameters() if id(p) not in owner]
    if orphans:
        raise ValueError(
            f"parameters {orphans[:5]} belong to no pipeline block; every parameter must be inside one of"
            f" {list(block_names)}."
        )
    return blocks


def partition(
    root: nn.Module,
    block_names: Sequence[str],
    stage_starts: Sequence[int],
    my_stages: Sequence[int],
    calls: Optional[Mapping[str, BlockCall]] = None,
) -> list[StageModule]:
    """Keep the blocks of ``my_stages`` (in place, FQNs unchanged), replace the others; return the stage modules."""
    blocks = block_modules(root, block_names)
    calls = calls or {}
    unknown = sorted(set(calls) - set(block_names))
    if unknown:
        raise ValueError(f"pipeline block calls are given for {unknown}, which are not pipeline blocks.")
    bounds = [*stage_starts, len(block_names)]
    stage_of = [s for s in range(len(stage_starts)) for _ in range(bounds[s], bounds[s + 1])]
    for name, stage in zip(block_names, stage_of):
        if stage not in my_stages:
            _set_submodule(root, name, OnAnotherStage(name, stage, persistent_buffer_names(blocks[block_names.index(name)])))
    return [
        StageModule(
            [b for b, s in zip(blocks, stage_of) if s == stage],
            [calls.get(n) for n, s in zip(block_names, stage_of) if s == stage],
        )
        for stage in my_stages
    ]


class _Stage(PipelineStage):
    """torch's ``PipelineStage`` with eight changes:

    * Shape inference feeds zeros, not uninitialized memory, to stages after the first. Tensor-parallel
      ranks of a stage must compute the same thing: with garbage inputs a mixture-of-experts router sends
      different token counts to the experts on each rank and their collectives no longer match.
    * Compute time (forward, backward, weight-gradient chunks) is added to ``clock[0]``, for the bubble.
    * ``forward_only``: the hand-off of input gradients between two adjacent stages on one rank is a no-op.
      torch 2.13's V-shaped schedules perform it even in ``eval()``, where no backward ran, and fail.
    * A micro-batch's receive buffers live from its receive to its forward (the activation) or backward (the output
      gradient), not from set-up for the run, one per micro-batch, as torch's stages keep them: what the forward
      and an input pass keep of them is all that stays (a ``2 m``-buffer floor otherwise, 13 GiB a rank at
      DeepSeek-V3's shapes and 120 micro-batches).
    * Its backward passes run in a :class:`~lightning_ciuic.parallel.split_backward.BackwardPasses`: on the calling
      thread; a weight pass recomputes nothing, and FP8 linears leave it their weights' gradients.
    * Under a multi-stage schedule's runtime, a send is waited for (its tensor let go) as soon as it must have completed,
      not at the step's end (``sends``, a :class:`~lightning_ciuic.parallel.pipeline_sends.SendRelease`).
    * A sharded stage inside :func:`~lightning_ciuic.parallel.fsdp.gradients_held` (an accumulation micro-step)
      ends the schedule's backward without the reduce torch runs after it: the gradients stay unreduced and the
      weights gathered (the module's parameters are then the gathered ones) until the optimizer step's last micro-step.
    * The last stage's loss, which the schedule keeps to the step's end, lets go of its graph once its backward ran.
    """

    def __init__(self, *args: Any, clock: list[float], forward_only: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._compute_clock, self._forward_only = clock, forward_only
        self.sends: Optional[SendRelease] = None
        self._passes = BackwardPasses()

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                tensor.zero_()
        return tensor

    def _timed(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if paired_overlap.in_pair():  # the runner times the pair as a whole
            return method(*args, **kwargs)
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self._compute_clock[0] += time.perf_counter() - start
            timeline.record(f"stage {self.stage_index} {method.__name__}", PIPELINE_COMPUTE, start, track="pp stages")

    def _setup_forward_recv_info(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_forward_recv_info(*args, **kwargs)
        for infos in self.args_recv_info.values():
            compat.release_receive_buffers(infos)

    def _setup_backward_recv_info(self, *args: Any, **kwargs: Any) -> None:
        super()._setup_backward_recv_info(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            compat.release_receive_buffers(infos)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        compat.allocate_receive_buffers(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if self.has_backward and not self.is_last:
            compat.allocate_receive_buffers(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        if self.sends is not None:
            self.sends.sending("SEND_F", self.stage_index, fwd_chunk_id)
        return super().get_fwd_send_ops(fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        if self.sends is not None:
            self.sends.sending("SEND_B", self.stage_index, bwd_chunk_id)
        return super().get_bwd_send_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.sends is not None:
            self.sends.before("F", self.stage_index, fwd_chunk_id)
        try:
            return self._timed(super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)
        finally:  # the activation received lives on where the forward keeps it (its backward's inputs), not here
            compat.release_receive_buffers(self.args_recv_info.get(fwd_chunk_id, ()))

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        if self.sends is not None:
            self.sends.before("B", self.stage_index, bwd_chunk_id)
        try:
            with self._passes.backward(bwd_chunk_id, full):
                return self._timed(super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)
        finally:  # the gradient received is read: what the weight pass needs of it, its input pass keeps
            compat.release_receive_buffers(self.grad_recv_info.get(bwd_chunk_id, ()))
            compat.detach_pipeline_loss(kwargs.get("loss", args[0] if args else None))  # the last stage's; else None

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._passes.weight(bwd_chunk_id):
            return self._timed(super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)

    def get_local_bwd_output(self, mb_index: int) -> Any:
        return None if self._forward_only else super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        if self._forward_only:
            return
        if any(grad is None for grad in next_stage_bwd_outputs):  # torch zeroes the buffer of a gradient that is None
            compat.allocate_receive_buffers(self.grad_recv_info[mb_index], self.device)
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if holds_gradients(self.submod):  # an accumulation micro-step: reduce with the optimizer step's last one
            compat.fsdp_end_backward(self.submod, reduce=False)
            return
        super().perform_reduce_grad(grad_scale_factor)


class PipelineRunner:
    """Runs this rank's stages with one of torch's pipeline schedules (see module docstring)."""

    def __init__(
        self,
        stage_modules: Sequence[StageModule],
        stage_ids: Sequence[int],
        num_stages: int,
        schedule: str,
        num_microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        check_int("num_microbatches", num_microbatches)
        self.stage_modules, self.stage_ids, self.num_stages = list(stage_modules), list(stage_ids), num_stages
        self.schedule_name, self.num_microbatches = schedule, num_microbatches
        self.loss_fn, self.group, self.device = loss_fn, group, device
        self._loss_divisor = 1.0
        self._active_microbatches = num_microbatches
        self.bubble = 0.0
        self.busy_seconds = self.step_seconds = 0.0
        self._schedules: dict[tuple, Any] = {}
        self._releases: dict[tuple, Optional[SendRelease]] = {}  # per schedule, as _schedules
        self._clock = [0.0]
        self.stage_metadata: Optional[Mapping[int, tuple[torch.Tensor, torch.Tensor]]] = None  # stage -> (input, output)
        self.sequence_shards = 1  # sequence parallelism: the tp ranks each stage's activations split the sequence over
        self.overlap_pairs = False  # DualPipeV's forward-backward pairs interleaved at their expert all-to-alls
        self.max_deferred_weight_backwards: Optional[int] = None  # weight_backlog's limit on split-backward schedules
        pp_size = dist.get_world_size(group)
        last_stage_rank = next(r for r in range(pp_size) if num_stages - 1 in self._ids_of(r, pp_size))
        self._last_stage_rank = dist.get_global_rank(group, last_stage_rank)

    def _ids_of(self, pp_rank: int, pp_size: int) -> list[int]:
        return stage_ids_of_rank(pp_rank, pp_size, len(self.stage_ids), self.schedule_name)

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (read afresh: sharding the stages replaces them)."""
        return [p for module in self.stage_modules for p in module.parameters()]

    def check_batch_size(self, batch_size: int, where: str = "a batch") -> None:
        if batch_size % self.num_microbatches:
            fits = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
            raise ValueError(
                f"{where} has {batch_size} samples, which num_microbatches={self.num_microbatches} does not divide;"
                f" use a batch size that is a multiple of {self.num_microbatches} (drop_last=True for a shorter last"
                f" batch), or num_microbatches among {fits}."
            )

    def check_sequence_length(self, shape: Sequence[int]) -> None:
        """Under sequence parallelism the stages hand each other their tp rank's part of the sequence, which must be
        the same length on every tp rank (a stage's input shape is fixed per schedule, its decoder layers' positions
        are counted from it): refused where tp does not divide the inputs' sequence (dimension 1)."""
        if self.sequence_shards > 1 and len(shape) > 1 and shape[1] % self.sequence_shards:
            raise ValueError(
                f"inputs of shape {tuple(shape)} have {shape[1]} positions, which the {self.sequence_shards} tensor-parallel"
                " ranks of a pipeline stage cannot split evenly under sequence parallelism: use sequence lengths"
                f" divisible by tensor_parallel_size={self.sequence_shards}, or sequence_parallel=False."
            )

    def _microbatches(self, batch_size: int, train: bool) -> int:
        """``num_microbatches`` for training (which must divide the batch); for evaluation and prediction, whose
        last batch is often shorter, the largest number up to it that divides the batch."""
        if train:
            self.check_batch_size(batch_size)
            return self.num_microbatches
        return max(d for d in range(1, self.num_microbatches + 1) if batch_size % d == 0)

    def _schedule(self, mode: str, batch_shape: tuple, microbatches: int) -> Any:
        key = (mode, batch_shape)
        if key not in self._schedules:
            placement = SCHEDULES[self.schedule_name].placement
            given = self.stage_metadata or {}
            stages = [
                _Stage(
                    module, stage_id, self.num_stages, self.device, group=self.group,
                    clock=self._clock, forward_only=placement == "v" and mode != "train",
                    input_args=given.get(stage_id, (None, None))[0], output_args=given.get(stage_id, (None, None))[1],
                )
                for module, stage_id in zip(self.stage_modules, self.stage_ids)
            ]
            cls = getattr(torch_schedules, SCHEDULES[self.schedule_name].cls_name)
            if mode != "train" and placement != "v":
                # Forward only, so the order does not matter; GPipe and looped BFS take any number of micro-batches.
                cls = torch_schedules.ScheduleGPipe if placement == "single" else torch_schedules.ScheduleLoopedBFS
            loss_fn = None if mode == "predict" else self._scaled_loss
            try:
                if placement == "single":
                    schedule = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
                else:
                    schedule = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
            except ValueError as err:  # e.g. DualPipeV with fewer micro-batches than stages
                raise ValueError(
                    f"a {mode} batch of shape {batch_shape} runs as {microbatches} micro-batches, which"
                    f" pipeline_schedule={self.schedule_name!r} cannot ({err}); use batch sizes divisible by"
                    f" num_microbatches={self.num_microbatches} (drop_last=True)."
                ) from err
            if self.stage_metadata is not None:
                compat.use_static_pipeline_warmup(schedule)
            weight_backlog.limit_schedule(schedule, self.max_deferred_weight_backwards if mode == "train" else None)
            if self.overlap_pairs and mode == "train":
                compat.run_pairs_with(schedule, self._run_pair)
            self._releases[key] = SendRelease.of(schedule, dist.get_rank(self.group))  # None: torch's own loops
            for stage in stages:  # a multi-stage runtime's sends waited for as soon as they must have completed
                stage.sends = self._releases[key]
            self._schedules[key] = schedule
        return self._schedules[key]

    def _run_pair(self, forward: Callable[[], None], backward: Callable[[], None]) -> None:
        """A DualPipeV forward-backward pair, interleaved (:func:`~lightning_ciuic.parallel.paired_overlap.run_pair`),
        timed as one chunk of compute."""
        start = time.perf_counter()
        try:
            paired_overlap.run_pair(forward, backward)
        finally:
            self._clock[0] += time.perf_counter() - start
            timeline.record("forward-backward pair", PIPELINE_COMPUTE, start, track="pp stages")

    def _scaled_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return local_loss(self.loss_fn(outputs, targets)) / (self._active_microbatches * self._loss_divisor)

    def _timed(self, call: Callable[[], Any]) -> Any:
        self._clock[0] = 0.0
        start = time.perf_counter()
        result = call()
        end = time.perf_counter()
        self.step_seconds = end - start
        self.busy_seconds = self._clock[0]
        self.bubble = max(0.0, 1.0 - self.busy_seconds / self.step_seconds) if self.step_seconds > 0 else 0.0
        _record_waits(start, end)
        return result

    def run(self, inputs: torch.Tensor, targets: Any, train: bool = True, loss_divisor: float = 1.0) -> torch.Tensor:
        """One batch through the pipeline; returns the mean micro-batch loss on every pipeline rank.

        With ``train``, backward runs too and each gradient gets ``1 / loss_divisor`` of the mean loss's gradient
        (``loss_divisor`` = gradient-accumulation steps, so accumulated gradients average over them)."""
        self.check_sequence_length(inputs.shape)
        self._active_microbatches = self._microbatches(inputs.shape[0], train)
        self._loss_divisor = loss_divisor if train else 1.0
        schedule = self._schedule("train" if train else "eval", tuple(inputs.shape), self._active_microbatches)
        args = (inputs,) if 0 in self.stage_ids else ()
        target = targets if self.holds_last_stage else None
        losses: list[torch.Tensor] = []
        call = schedule.step if train else schedule.eval
        release = self._releases.get(("train" if train else "eval", tuple(inputs.shape)))
        # return_outputs=False: else the last stage keeps every micro-batch's output (the logits) to the step's end
        with release.step() if release is not None else contextlib.nullcontext():
            self._timed(lambda: call(*args, target=target, losses=losses, return_outputs=False))
        if train:
            self._gradients_in_parameter_placements()
        # Every pipeline rank must allocate the dtype the last stage sends: the model's (float64 under "64-true").
        dtype = next((p.dtype for p in self.parameters()), torch.get_default_dtype())
        loss = torch.zeros((), dtype=dtype, device=self.device)
        if self.holds_last_stage:
            loss = (torch.stack([l.detach() for l in losses]).sum() * self._loss_divisor).to(self.device, dtype)
        dist.broadcast(loss, src=self._last_stage_rank, group=self.group)
        return loss

    def _gradients_in_parameter_placements(self) -> None:
        """The zero-bubble schedules compute weight gradients apart (``stage_backward_weight``) and assign them to
        ``.grad`` themselves, which runs no post-accumulate-grad hook: a replicated DTensor parameter used on
        sequence-sharded activations (a sequence-parallel norm's weight) is left with a ``Partial`` gradient, each tp
        rank's unreduced share, which a global-norm clip would take for shards. Brought to the parameter's placements
        here, once per step, as the hooks do for the other schedules (no-op where they did)."""
        for param in self.parameters():
            gradient_to_parameter_placements(param)

    def forward(self, inputs: torch.Tensor) -> Any:
        """Forward only; the last stage's output, sent to every pipeline rank."""
        self.check_sequence_length(inputs.shape)
        schedule = self._schedule("predict", tuple(inputs.shape), self._microbatches(inputs.shape[0], train=False))
        args = (inputs,) if 0 in self.stage_ids else ()
        box = [self._timed(lambda: schedule.eval(*args))]
        dist.broadcast_object_list(box, src=self._last_stage_rank, group=self.group)
        return box[0]
