"""The one training step the plan's step phase measures, and the figures it gives.

Contract: :func:`train_steps` runs ``steps`` training steps of a
:class:`~lightning_ciuic.parallel.pipeline_module.PipelineModule` (``pipelined_loss`` on ``(input_ids, targets)``,
forward, backward, the data-parallel engine's gradient synchronization, the optimizers' step), or of a
:class:`~lightning_ciuic.parallel.pipeline.PipelineRunner`'s schedule, tracked by torch's ``MemTracker``, and returns
the last step's :class:`StepMemory`: its peak, the model states held after it (:func:`held_bytes`, on each rank's own
tensors), its FLOPs (:mod:`~lightning_ciuic.planner.flops`) and the bytes its collectives sent per mesh axis
(:mod:`~lightning_ciuic.planner.traffic`). It runs on fake tensors in the planner (:mod:`~lightning_ciuic.planner.step`)
and on real ones in the test that holds the planner to real runs. :class:`StepSpec` is the micro-batch
(:func:`token_batch`: token ids within the module's vocabulary); :class:`StepFigures` what a plan keeps of a step.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_ciuic import compat
from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.parallel.pipeline import PipelineRunner
from lightning_ciuic.planner.flops import LocalFlops, experts_modules
from lightning_ciuic.parallel.tensor import loss_parallel_context
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


@dataclass(frozen=True)
class StepFigures:
    """What a plan takes from a step: bytes, FLOPs and the collectives' bytes and groups."""

    activations: int  # the peak less the model states
    traffic: dict[str, dict[str, int]]  # mesh axis -> collective -> bytes this rank sent in the step
    axis_ranks: dict[str, list[int]]  # mesh axis -> the global ranks of this rank's group on it
    flops: int  # recomputed forwards included
    forward_flops: int
    experts_forward_flops: int = 0  # of forward_flops, the packed experts' (planner.flops.experts_modules)
    calls: dict[str, dict[str, int]] = field(default_factory=dict)  # mesh axis -> collective -> calls in the step
    fp8_flops: int = 0  # of flops, the FP8 GEMMs' (gemm_precision="fp8")

    def extended(self, deeper: "StepFigures", depth: int, layers: int) -> "StepFigures":
        """The figures at ``layers`` layers, on the line through ``self`` (``depth`` layers) and ``deeper`` (2x)."""

        def line(a: int, b: int) -> int:
            return a + round((b - a) * (layers - depth) / depth)

        def lines(mine: dict[str, dict[str, int]], theirs: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
            return {
                axis: {
                    name: line(mine.get(axis, {}).get(name, 0), theirs.get(axis, {}).get(name, 0))
                    for name in set(mine.get(axis, {})) | set(theirs.get(axis, {}))
                }
                for axis in set(mine) | set(theirs)
            }

        traffic = lines(self.traffic, deeper.traffic)
        return StepFigures(
            line(self.activations, deeper.activations), traffic, {**self.axis_ranks, **deeper.axis_ranks},
            line(self.flops, deeper.flops), line(self.forward_flops, deeper.forward_flops),
            line(self.experts_forward_flops, deeper.experts_forward_flops), lines(self.calls, deeper.calls),
            line(self.fp8_flops, deeper.fp8_flops),
        )

    @property
    def experts_flops(self) -> float:
        """The packed experts' share of the step's FLOPs: ``flops`` times their share of the forward's (their backward
        and recomputation taken as proportional to their forward)."""
        return self.flops * self.experts_forward_flops / self.forward_flops if self.forward_flops else 0.0


@dataclass(frozen=True)
class StepMemory:
    """What :func:`train_steps` measured on one rank (bytes)."""

    peak: int
    model_states: int  # parameters, gradients, optimizer state and engine buffers held after the step (held_bytes)
    traffic: dict[str, dict[str, int]]  # mesh axis -> collective -> bytes this rank sent in the last step
    axis_ranks: dict[str, list[int]]  # mesh axis -> the global ranks of this rank's group on it
    flops: int  # counted in the last step (recomputed forwards included)
    forward_flops: int  # counted in its forward
    experts_forward_flops: int = 0  # of it, inside the packed experts' modules
    calls: dict[str, dict[str, int]] = field(default_factory=dict)  # mesh axis -> collective -> calls
    fp8_flops: int = 0  # of flops, the FP8 GEMMs'

    @property
    def activations(self) -> int:
        return self.peak - self.model_states

    def figures(self) -> StepFigures:
        return StepFigures(
            self.activations, self.traffic, self.axis_ranks, self.flops, self.forward_flops, self.experts_forward_flops,
            self.calls, self.fp8_flops,
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
    warm_from_zero_gradients: bool = False, loss_parallel: bool = False,
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
    the step phase's warm-up, a whole schedule cheaper (the tests hold its figures to real runs warmed by a step).
    ``loss_parallel``: the module's logits come out vocabulary-sharded (``Parallelized.loss_parallel``): each step's
    loss and backward run inside :func:`~lightning_ciuic.parallel.tensor.loss_parallel_context`, as the strategy's do."""
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
            watched = flops.watching(experts_modules(module)) if last else contextlib.nullcontext()
            with traffic if last else contextlib.nullcontext(), flops if last else contextlib.nullcontext(), watched:
                with loss_parallel_context(loss_parallel):  # the last pipeline stage's loss too
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
        flops=flops.total, forward_flops=flops.forward, experts_forward_flops=flops.experts_forward,
        calls={axis: dict(by) for axis, by in traffic.calls.items()}, fp8_flops=flops.fp8,
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
