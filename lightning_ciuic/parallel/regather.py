"""Megatron-LM's sequence-parallel column-parallel linears: a linear that reads a sequence-gathered input saves this
rank's part of the sequence for its backward, and gathers it again there.

Contract: under sequence parallelism a module between the sequence-parallel norms (an attention, an MLP) gathers its
sequence-sharded input (``tensor.gathered_input``); while its forward runs, the gathered tensor is *recorded*
(:func:`record_gathered`: the gathered tensor, the rank's part it came from, the tp mesh; forgotten again by
:func:`forget_gathered` when the module's forward ends, exceptions included). A linear planned :class:`ColwiseSavingShard`
(torch's ``ColwiseParallel`` otherwise, and exactly it for any input that is not a recorded gathered tensor, a view of
one included) that is called on a recorded tensor computes the same ``F.linear`` of its weight's local shard, but keeps
for its backward the rank's part (``1/tp`` of the sequence) instead of the gathered whole: autograd's own ``F.linear``
keeps the whole, tp times the bytes. Backward gathers the part again (an all-gather over tp, once for all the linears
that read the same gathered tensor: q/k/v share one, gate/up another; dropped after the last of them) and computes the
weight's gradient and the input's. The input gradients of those linears are each rank's part of a sum over tp (its
heads' part): autograd adds them up first (they reach the rank's part through a node of their own, not through the
gather) and their sum is reduce-scattered over tp to the rank's part of the sequence once per gathered tensor, as
Megatron-LM and torchtitan do (torch's ``ColwiseParallel`` on a plain input all-reduces each linear's own). A replicated
linear reading it (:class:`ReplicatedSavingShard`: MLA's latent down-projections) keeps the part too; its gradient,
whole on every rank, and anything else's that reads the gathered tensor go back through the gather. Autocast is honoured: the gradients are computed in the forward's compute dtype and
returned in the dtypes of the input, weight and bias. Works under recomputation (a recomputed forward records and
gathers again; the recorded part is a saved tensor like any other, checkpointed or dropped as the mode says), pipeline
schedules (a record per micro-batch's forward) and FSDP2 (the weight's local shard is that of its unsharded DTensor).

No Lightning imports.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


class Regather:
    """The gathered input gathered again in backward, once for all the linears reading it (``readers``, counted in
    their forwards); dropped when the last of them has used it."""

    def __init__(self, mesh: DeviceMesh, dim: int) -> None:
        self.mesh, self.dim = mesh, dim
        self.readers = 0
        self._full: Optional[torch.Tensor] = None

    def full(self, local: torch.Tensor) -> torch.Tensor:
        if self._full is None:
            self._full = DTensor.from_local(local, self.mesh, [Shard(self.dim)], run_check=False).redistribute(
                self.mesh, [Replicate()]
            ).to_local()
        return self._full

    def done(self) -> None:
        self.readers -= 1
        if self.readers <= 0:
            self._full = None


class Gathered:
    """A gathered tensor's record while the module that gathered it runs (see the module docstring)."""

    def __init__(self, full: torch.Tensor, local: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        self.full = weakref.ref(full)
        self.local, self.mesh = local, mesh
        self.regather = Regather(mesh, dim)
        self._summed: Optional[torch.Tensor] = None

    def column_parallel_input(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as the column-parallel linears read it: the same values (no copy), its gradient (the sum of theirs,
        each rank's part of a sum over tp) reduce-scattered over tp to the rank's part of the sequence, once."""
        if self._summed is None:
            self._summed = _ReduceScattered.apply(self.local, full.detach(), self.mesh, self.regather.dim)
        return self._summed


class _ReduceScattered(torch.autograd.Function):
    """``full``'s values, as a function of ``local``: backward reduce-scatters the (partial) gradient to ``local``."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, full: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
        ctx.mesh, ctx.dim = mesh, dim
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        partial_sum = DTensor.from_local(grad, ctx.mesh, [Partial()], run_check=False)
        return partial_sum.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local(), None, None, None


_RECORDS: dict[int, Gathered] = {}


def record_gathered(full: torch.Tensor, local: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
    """``full`` was gathered over ``mesh`` on ``dim`` from this rank's ``local`` part (while its module runs)."""
    _RECORDS[id(full)] = Gathered(full, local, mesh, dim)


def forget_gathered(full: torch.Tensor) -> None:
    _RECORDS.pop(id(full), None)


def gathered(tensor: Any) -> Optional[Gathered]:
    """The record of ``tensor`` if it is a recorded gathered tensor itself (not a view of one), else None."""
    record = _RECORDS.get(id(tensor))
    return record if record is not None and record.full() is tensor else None


class _LinearSavingShard(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` keeping ``local`` (the part ``x`` was gathered from) instead of ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, local: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                regather: Regather) -> torch.Tensor:
        regather.readers += 1
        ctx.regather, ctx.input_dtype = regather, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(local, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        local, weight = ctx.saved_tensors
        try:
            full = ctx.regather.full(local)
            rows = grad.reshape(-1, grad.shape[-1])
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = (rows @ weight.to(grad.dtype)).view(*full.shape[:-1], weight.shape[1]).to(ctx.input_dtype)
            if ctx.needs_input_grad[2]:
                grad_w = (rows.t() @ full.reshape(-1, full.shape[-1]).to(grad.dtype)).to(weight.dtype)
            if ctx.needs_input_grad[3]:
                grad_b = rows.sum(0).to(ctx.bias_dtype)
        finally:
            ctx.regather.done()
        return grad_x, None, grad_w, grad_b, None


def _local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _forward_saving_shard(module: nn.Linear, forward: Any, mesh: DeviceMesh, x: torch.Tensor) -> Any:
    record = gathered(x)
    if record is None:
        return forward(x)
    out = _LinearSavingShard.apply(
        record.column_parallel_input(x), record.local, _local(module.weight), _local(module.bias), record.regather
    )
    return DTensor.from_local(out, mesh, [Shard(-1)], run_check=False)  # as ColwiseParallel's linear computes it


class ColwiseSavingShard(ColwiseParallel):
    """torch's ``ColwiseParallel`` (same arguments, same parameters), saving this rank's part of a recorded gathered
    input for its backward instead of the gathered whole (see the module docstring). ``nn.Linear`` only."""

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: tuple,
                          device_mesh: DeviceMesh) -> Any:
        if input_layouts == (Replicate(),) and gathered(inputs[0]) is not None:
            return inputs[0]  # the forward below reads it as the plain tensor it is
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ColwiseSavingShard applies to nn.Linear, and was given a {type(module).__name__}.")
        module = super()._apply(module, device_mesh)
        if self.input_layouts != (Replicate(),):
            return module  # its input is not a gathered one: torch's ColwiseParallel as it is
        module.forward = partial(_forward_saving_shard, module, module.forward, device_mesh)
        return module


class ReplicatedSavingShard(ParallelStyle):
    """A replicated ``nn.Linear`` (its parameters left as they are) that may read a recorded gathered input (MLA's
    latent down-projections): it then keeps this rank's part of it too; its input gradient, whole on every rank, flows
    back through the gather as a replicated module's does. Any other input: the linear as it is."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        save_shard_when_replicated(module)
        return module


def save_shard_when_replicated(module: nn.Module) -> None:
    """``module`` (a replicated ``nn.Linear``) keeps the rank's part of a recorded gathered input (see the class)."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"ReplicatedSavingShard applies to nn.Linear, and was given a {type(module).__name__}.")
    module.forward = partial(_replicated_forward, module, module.forward)


def _replicated_forward(module: nn.Linear, forward: Any, x: torch.Tensor) -> torch.Tensor:
    record = gathered(x)
    if record is None:
        return forward(x)
    return _LinearSavingShard.apply(x, record.local, _local(module.weight), _local(module.bias), record.regather)
