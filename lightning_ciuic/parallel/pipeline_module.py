"""Pipeline parallelism in Lightning's loop: the module protocol and the cut of a module into stages (no Lightning imports).

The protocol (:class:`PipelineModule`, a mixin for a ``LightningModule``) is three methods:

* ``pipeline_blocks()``: the names of the sub-modules that, applied in order to one tensor, are the model
  (e.g. ``["model.embed", "model.layers.0", ..., "model.norm", "model.head"]``);
* ``pipeline_loss(outputs, targets)``: the loss of one micro-batch (a mean over its samples);
* ``pipeline_inputs(batch)`` (optional): ``(inputs, targets)`` of a batch; by default ``batch[0], batch[1]``;
* ``pipeline_block_calls()`` (optional): ``{name: call(block, x)}`` for blocks whose forward needs more than
  the previous block's output.

Steps then compute their loss with ``self.pipelined_loss(batch)``: without pipeline parallelism (any
strategy, or ``pipeline_parallel_size=1``) that is ``pipeline_loss(self(inputs), targets)``; with it, the
pipeline schedule runs the micro-batches through the stages, forward and backward in training (Lightning's
backward is then skipped), forward only in validation, and the mean loss, computed on the last stage, is
returned on every rank, so ``self.log`` shows the true loss everywhere. ``self.pipelined_forward(inputs)``
gives the model's output on every rank (``predict_step``). On a middle stage (neither first nor last) the training
batch is a :class:`NotRead` (that stage does not read the data: :mod:`lightning_ciuic.data.stages`, which yields it,
also names it): ``pipelined_loss`` runs the schedule on its shape.

The module's runner is handed to it explicitly: :func:`build_pipeline` attaches the runner it builds
(:meth:`PipelineModule.attach_pipeline`), and ``self.pipeline`` is that runner (``None`` before a cut, and in
copies of the module: a copy is no rank's stages); the module reads nothing of the strategy's. Under a Trainer,
``pipelined_loss`` reads the Trainer's public ``accumulate_grad_batches``.

:func:`build_pipeline` cuts the module's blocks into ``pipeline_parallel_size * stages_per_rank`` stages
(balanced by the parameters a token passes, :func:`~lightning_ciuic.parallel.experts.parameters_per_token`,
unless split points are given), keeps this rank's stages in place (parameter
names unchanged, so checkpoints load into any layout) and returns the :class:`PipelineRunner`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic import compat
from lightning_ciuic.validation import check_int
from lightning_ciuic.parallel.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    BlockCall,
    OnAnotherStage,
    PipelineRunner,
    balanced_split,
    block_modules,
    partition,
    resolve_stages_per_rank,
    split_at,
    stage_ids_of_rank,
)
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.experts.layout import parameters_per_token
from lightning_ciuic.parallel.tensor import local_loss

_RUNNER = "_ciuic_pipeline_runner"  # where a PipelineModule keeps the runner attached to it


class NotRead:
    """What a middle pipeline stage's training loader yields in place of a batch: the first stage's inputs' ``shape``
    (a ``torch.Size``, all the schedule needs) and ``batch_size``. It answers for the inputs' metadata only: indexing
    it (``batch[0]``, ``batch["input_ids"]``) gives itself, and ``size()``, ``numel()``, ``dim()`` are the inputs',
    so a step that counts tokens runs alike on every stage; it holds no values (arithmetic on it, iterating it
    raise ``TypeError``)."""

    __iter__ = None  # not iterable (indexing it gives itself)

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = torch.Size(shape)

    @property
    def batch_size(self) -> int:
        return self.shape[0] if len(self.shape) else 1

    def __getitem__(self, key: Any) -> NotRead:
        return self

    def size(self, dim: Optional[int] = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"NotRead(shape={tuple(self.shape)})"


class PipelineModule(metaclass=abc.ABCMeta):
    """Mixin for a LightningModule that :class:`HybridParallelStrategy` can cut into pipeline stages
    (a class that leaves out one of the abstract methods cannot be instantiated)."""

    @abc.abstractmethod
    def pipeline_blocks(self) -> Sequence[str]:
        """Names of the sub-modules that, applied in order, compute the model's output from its inputs."""

    @abc.abstractmethod
    def pipeline_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss of one micro-batch: a mean over its samples."""

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a batch; by default its first two items."""
        return batch[0], batch[1]

    def pipeline_block_calls(self) -> Mapping[str, BlockCall]:
        """How to run blocks whose forward needs more than one tensor: ``{name: call(block, x) -> y}``."""
        return {}

    def attach_pipeline(self, runner: Optional[PipelineRunner]) -> None:
        """Run this module's steps through ``runner`` (its stages on this rank; ``None``: not pipelined)."""
        self.__dict__[_RUNNER] = runner

    @property
    def pipeline(self) -> Optional[PipelineRunner]:
        """The pipeline runner :func:`build_pipeline` attached, or None when the module is not pipelined."""
        return self.__dict__.get(_RUNNER)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickling) holds no runner: the runner is this rank's process groups and stages."""
        state = dict(super().__getstate__())  # type: ignore[misc]
        state.pop(_RUNNER, None)
        return state

    def pipelined_loss(self, batch: Any) -> torch.Tensor:
        """The batch's loss; under pipeline parallelism also runs backward when training (see module docstring)."""
        runner = self.pipeline
        if isinstance(batch, NotRead):  # a middle stage's training step: the schedule needs only the inputs' shape
            compat.set_logged_batch_size(self.trainer, batch.batch_size)
            inputs, targets = batch, None
        else:
            inputs, targets = self.pipeline_inputs(batch)
        if runner is None:
            return local_loss(self.pipeline_loss(self(inputs), targets))  # vocabulary-sharded logits: a DTensor loss
        train = bool(self.training and torch.is_grad_enabled())
        accumulation = self.trainer.accumulate_grad_batches if train else 1
        return runner.run(inputs, targets, train=train, loss_divisor=accumulation)

    def pipelined_forward(self, inputs: Any) -> Any:
        """The model's output for ``inputs``, on every rank."""
        runner = self.pipeline
        return self(inputs) if runner is None else runner.forward(inputs)


@dataclass(frozen=True)
class PipelineConfig:
    """The strategy's pipeline arguments, validated."""

    schedule: str = "1f1b"
    num_microbatches: int = 4
    stages_per_rank: Optional[int] = None
    split_points: Optional[tuple[str, ...]] = None
    max_deferred_weight_backwards: Optional[int] = None  # split-backward schedules: parallel/weight_backlog.py

    def __post_init__(self) -> None:
        check_int("num_microbatches", self.num_microbatches)
        resolve_stages_per_rank(self.schedule, self.stages_per_rank)
        check_int("max_deferred_weight_backwards", self.max_deferred_weight_backwards, minimum=0, allowed=(None,))
        if self.max_deferred_weight_backwards is not None and self.schedule not in SPLIT_BACKWARD_SCHEDULES:
            raise ValueError(
                f"max_deferred_weight_backwards={self.max_deferred_weight_backwards} bounds the weight backwards a"
                f" schedule defers, and pipeline_schedule={self.schedule!r} runs whole backwards and defers none; use"
                f" one of {sorted(SPLIT_BACKWARD_SCHEDULES)}, or max_deferred_weight_backwards=None."
            )

    @property
    def local_stages(self) -> int:
        return resolve_stages_per_rank(self.schedule, self.stages_per_rank)

    def check_layout(self, pp: int) -> None:
        """Raise before any process starts if the schedule cannot run on ``pp`` ranks."""
        stages = pp * self.local_stages
        if self.schedule in ("1f1b", "dualpipev") and self.num_microbatches < stages:  # torch's schedules refuse fewer
            count = f"pipeline_parallel_size {pp}" + (f" x {self.local_stages}" if self.local_stages > 1 else "")
            raise ValueError(
                f"pipeline_schedule={self.schedule!r} needs at least as many micro-batches as stages: num_microbatches="
                f"{self.num_microbatches}, stages = {count} = {stages}; use num_microbatches >= {stages}, or"
                f" pipeline_schedule='gpipe' (any number of micro-batches)."
            )


def stage_starts(module: nn.Module, names: Sequence[str], num_stages: int, config: PipelineConfig) -> list[int]:
    if config.split_points is not None:
        return split_at(names, config.split_points, num_stages)
    if len(names) < num_stages:
        raise ValueError(
            f"{type(module).__name__} has {len(names)} pipeline blocks, fewer than the {num_stages} stages asked for"
            f" (pipeline_parallel_size x stages_per_rank); use at most {len(names)} stages or split the model finer."
        )
    sizes = [parameters_per_token(block) for block in block_modules(module, names)]
    return balanced_split(sizes, num_stages)


def build_pipeline(
    module: nn.Module, pp_mesh: DeviceMesh, config: PipelineConfig, device: torch.device
) -> PipelineRunner:
    """Cut ``module`` (a :class:`PipelineModule`) into stages over ``pp_mesh`` (the layout's ``pp`` view); keep this
    rank's, in place, and
    attach the runner to the module (:meth:`PipelineModule.attach_pipeline`)."""
    if not isinstance(module, PipelineModule):
        raise TypeError(
            f"pipeline_parallel_size={pp_mesh.size()} needs a LightningModule that implements the PipelineModule"
            f" protocol (lightning_ciuic.PipelineModule: pipeline_blocks() and pipeline_loss()); {type(module).__name__}"
            " does not. See docs/pipeline.md."
        )
    names = list(module.pipeline_blocks())
    per_rank = config.local_stages
    num_stages = pp_mesh.size() * per_rank
    layout = getattr(module, "_pipeline_layout", None)
    if layout is None or layout[0] != (names, num_stages):  # a module already cut keeps its cut (a second fit)
        if any(isinstance(m, OnAnotherStage) for m in module.modules()):
            raise RuntimeError("this module was cut into pipeline stages for another layout; build a new one.")
        layout = ((names, num_stages), stage_starts(module, names, num_stages, config))
        module._pipeline_layout = layout
    my_stages = stage_ids_of_rank(pp_mesh.get_local_rank(), pp_mesh.size(), per_rank, config.schedule)
    stages = partition(module, names, layout[1], my_stages, module.pipeline_block_calls())
    runner = PipelineRunner(
        stages, my_stages, num_stages, config.schedule, config.num_microbatches, module.pipeline_loss,
        pp_mesh.get_group(), device,
    )
    runner.max_deferred_weight_backwards = config.max_deferred_weight_backwards
    module.attach_pipeline(runner)
    return runner
