"""Sharded: data parallelism that shards the model (torch's FSDP2, ``fully_shard``) over ``dp_shard``, with
replicas of the shards over ``dp_replicate`` (HSDP).

Contract (a :class:`~lightning_ciuic.comm.data_parallel.DataParallel` engine):

* ``setup(module, groups, stages=())``: the module is already sharded
  (:func:`~lightning_ciuic.parallel.fsdp.shard`, called by :func:`~lightning_ciuic.parallel.parallelize.parallelize`,
  or the user's own ``fully_shard`` calls); each :class:`~lightning_ciuic.comm.reduction.ReductionGroup` names the
  FSDP2 units that reduce its parameters over its mesh (``"dense"``: the model's units and its roots, one per pipeline
  stage of this rank; ``"experts"``: each packed-experts module, over the ranks holding the same experts), from which
  :func:`sharding_of` makes the :class:`~lightning_ciuic.parallel.fsdp.FSDPLayout` the engine drives. A unit's parameters are
  all-gathered before its forward and, with ``reshard_after_forward=True`` (ZeRO-3), freed after it and gathered
  again for its backward. Its gradients are reduce-scattered, averaged, during backward (and all-reduced over
  ``dp_replicate``). Build the optimizer after set-up: it holds state for the shards only.
* Mixed precision (FSDP2's ``MixedPrecisionPolicy``): ``param_dtype`` is what the all-gather and the compute use,
  ``reduce_dtype`` what the gradient reduce-scatter uses (``fp16``/``bf16`` communication compression sets it);
  ``cpu_offload`` keeps shards, gradients and optimizer state in host memory.
* Every unit's all-gather and reduce-scatter run through :mod:`~lightning_ciuic.comm.fsdp_comms` (FSDP2's
  custom collectives): timed (``stats.gather_seconds`` / ``scatter_seconds``, both also in ``comm_seconds``) and
  their bytes counted as they run (pipeline micro-batches' re-gathers included). ``gradient_codec="int8"`` (or
  ``"nf4"``) makes the reduce-scatter a quantized all-to-all (ZeRO++'s qgZ), with ``error_feedback``;
  ``weight_codec="int8"`` quantizes the all-gather (qwZ).
* ZeRO stages (``config.stage_of``; :attr:`stage`): 3 gathers each unit's weights for every forward and backward; 2
  and 1 gather them once per optimizer step (units not resharded after forward, nor after the backward of a micro-step
  but the last, under pipelines by torch's stage as well) and reduce-scatter the gradients once per step: 2 unit by
  unit in the last backward, 1 (Megatron's distributed optimizer, DeepSeek-V3's ZeRO-1) holding every gradient whole
  until the end of backward and reduce-scattering them in one go in ``after_backward`` (under pipeline parallelism
  torch's stage does so already after the schedule's last backward: 1 is 2 there). The optimizer steps the shards in
  all three.
* ``no_sync()``: FSDP2's ``set_requires_gradient_sync(False)``: gradients accumulate unreduced (and unsharded)
  until the last micro-batch, whose backward reduce-scatters the sum; with ZeRO-1/2 the weights stay gathered
  (``set_reshard_after_backward(False)``), and pipelined stages skip their end-of-schedule reduce
  (:func:`~lightning_ciuic.parallel.fsdp.gradients_held`).
* ``after_backward(accumulated)``: ZeRO-1's one reduce-scatter (unless ``accumulated``: the gradients came from a
  pipeline schedule, reduced by its stages, or were set without a backward); else nothing to wait for: FSDP2 waits
  for its reduce-scatters at the end of backward. It adds
  the bytes of FSDP2's own all-reduce over ``dp_replicate`` (HSDP), computed for a ring (2 (r-1)/r of each unit's
  gradient shard, over the unit's own mesh), not measured, and not timed.
* ``payload()``: (parameter values gathered, units): read from the sharded units (:func:`owned_numel`), each
  parameter counted once, in the unit FSDP2 gives it (a unit's own: those under it that no unit nested in it
  owns), at the size its all-gather yields on this rank (a tensor-parallel parameter's tp-local size). The
  float32 gradient bytes each synchronized backward adds to ``bytes_reduced`` follow from it.
* ``state_dict()``: the quantized reduce-scatters' error-feedback residuals (per rank, saved with checkpoints and
  snapshots like the replicated engine's; ``has_rank_state`` says whether there are any); ``label``: what the
  monitor shows (``"none"``, ``"fp16"``, ``"int8"``, with ``"+ int8 weights"`` for a quantized all-gather).

No Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_ciuic import compat
from lightning_ciuic.wire.codecs import dense_codec
from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.comm.fsdp_comms import AllGatherComm, ReduceScatterComm
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.comm.reduction import ReductionGroup
from lightning_ciuic.wire.timing import DeviceClock
from lightning_ciuic.parallel.fsdp import FSDPLayout, ShardingConfig, check_offload, gradients_held
from lightning_ciuic.tensors import device_of


class Sharded(DataParallel):
    """Parameters, gradients and optimizer state sharded over ``dp_shard`` (FSDP2); see the module docstring."""

    schedule_syncs = True  # torch's pipeline stage reduces an FSDP2 root's gradients after a schedule's last backward

    def __init__(self, config: ShardingConfig = ShardingConfig()) -> None:
        self.config = config
        self.mesh: Optional[DeviceMesh] = None
        self.module: Optional[nn.Module] = None
        self.roots: list[FSDPModule] = []  # the module, or under pipeline parallelism each stage this rank runs
        self.units: list[nn.Module] = []
        self._stats = SyncStats()
        self._sync = True
        self._unit_numel: list[int] = []  # parameters each unit owns, the roots' last (gathered sizes: owned_numel)
        self._replica_bytes = 0
        self.gradient_comms: list[ReduceScatterComm] = []  # one per unit, the roots' last
        self.pipelined, self.stage, self._defer = False, 3, False

    def setup(self, module: nn.Module, groups: Sequence[ReductionGroup], stages: Sequence[nn.Module] = ()) -> None:
        self.close()
        layout = sharding_of(module, groups)
        check_offload(self.config.cpu_offload, layout.mesh.device_type)
        self.mesh, self.group = layout.mesh, layout.mesh.get_group(layout.mesh.ndim - 1)
        self.module, self.roots, self.units = module, layout.roots, layout.units  # type: ignore[assignment]
        self._unit_numel = owned_numel(layout)
        clock = DeviceClock(device_of(layout.mesh))
        gradient_codec = dense_codec(self.config.gradient_codec) if self.config.gradient_codec else None
        gather = AllGatherComm(self._stats, clock, dense_codec(self.config.weight_codec) if self.config.weight_codec else None)
        for unit in (*layout.units, *layout.roots):
            scatter = ReduceScatterComm(self._stats, clock, gradient_codec, self.config.error_feedback)
            unit.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
            unit.set_custom_all_gather(gather)  # type: ignore[operator]
            self.gradient_comms.append(scatter)
        self._replica_bytes = self._replica_traffic()  # derived once: the units and dtypes do not change
        self.pipelined = bool(stages)
        self.stage = self.config.stage_of(self.pipelined)
        self._defer = self.stage == 1 and not self.pipelined  # ZeRO-1: one reduce-scatter after backward
        self._hold(False)

    def _hold(self, accumulating: bool) -> None:
        """The roots' FSDP2 flags for the next backward: gradients reduced in it (unless accumulating or ZeRO-1
        defers them) and weights resharded after it (unless accumulating under ZeRO-1/2, or ZeRO-1 holds them until
        its reduce)."""
        for root in self.roots:
            root.set_requires_gradient_sync(not (accumulating or self._defer))
            root.set_reshard_after_backward(not ((accumulating and self.stage < 3) or self._defer))

    def before_step(self, global_step: int) -> list[str]:
        return []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._hold(True)
        self._sync = False
        try:
            with gradients_held(self.roots if self.stage < 3 else ()):
                yield
        finally:
            self._hold(False)
            self._sync = True

    def after_backward(self, accumulated: bool = False) -> None:
        if self._sync and self._defer and not accumulated:
            for root in self.roots:
                compat.fsdp_end_backward(root, reduce=True)
            self._hold(False)
        if self._sync:
            self._stats.bytes_sent += self._replica_bytes
            self._stats.bytes_reduced += sum(self._unit_numel) * 4

    def _replica_traffic(self) -> int:
        """Bytes this rank sends per synchronized backward in FSDP2's own all-reduce over ``dp_replicate`` (HSDP; a
        ring: 2 (r-1)/r of each unit's gradient shard, over the unit's own mesh). The gathers and reduce-scatters
        count themselves (fsdp_comms)."""
        reduce_bytes = (self.config.reduce_dtype or self.config.param_dtype or _param_dtype(self.module)).itemsize
        total = 0.0
        for unit, numel in zip((*self.units, *self.roots), self._unit_numel):
            mesh = compat.fsdp_mesh(unit)
            if mesh is not None and mesh.ndim == 2:  # (dp_replicate, dp_shard)
                replicate, shard = mesh.size(0), mesh.size(1)
                total += 2 * (numel / shard) * reduce_bytes * (replicate - 1) / replicate
        return int(total)

    @property
    def stats(self) -> SyncStats:
        return self._stats

    def payload(self) -> tuple[int, int]:
        return sum(self._unit_numel), len(self._unit_numel)

    @property
    def has_rank_state(self) -> bool:
        return self.config.gradient_codec is not None and self.config.error_feedback

    @property
    def label(self) -> str:
        reduce = self.config.gradient_codec or {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.config.reduce_dtype, "none")
        return reduce + (f" + {self.config.weight_codec} weights" if self.config.weight_codec else "")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals of the quantized reduce-scatters (``gradient_codec``), by unit."""
        return {f"reduce_scatter.{i}": c.residual for i, c in enumerate(self.gradient_comms) if c.residual is not None}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, comm in enumerate(self.gradient_comms):
            comm.residual = state.get(f"reduce_scatter.{i}")

    def close(self) -> None:
        self.module, self.roots, self.units, self.mesh, self.gradient_comms = None, [], [], None, []


def sharding_of(module: nn.Module, groups: Sequence[ReductionGroup]) -> FSDPLayout:
    """The FSDP2 units of ``groups`` as one layout over the first group's mesh: the other groups' units first (nested
    in the first group's roots), then the first group's; the roots are the units no other unit holds."""
    ordered = [unit for group in (*groups[1:], *groups[:1]) for unit in group.units]
    if not ordered:
        raise ValueError(
            f"{type(module).__name__} is not sharded: the sharded engine's groups name no FSDP2 units. Shard it first"
            " (parallelize() with data_parallel_shard_size > 1, or fully_shard) and set the engine up with"
            " reduction_groups(...) of the result, or use the replicated engine."
        )
    inner = {id(sub) for unit in ordered for sub in unit.modules() if sub is not unit}
    roots = [unit for unit in ordered if id(unit) not in inner]
    return FSDPLayout(groups[0].mesh, roots, [unit for unit in ordered if id(unit) in inner])  # type: ignore[arg-type]


def owned_numel(layout: FSDPLayout) -> list[int]:
    """How many parameter values each unit's all-gather yields on this rank, ``layout.units`` first then its roots:
    a unit owns the parameters under it that no FSDP2 unit nested in it owns (FSDP2's grouping: each parameter
    counts once), each at :func:`_gathered_numel` over the unit's own mesh."""
    counts: dict[int, int] = {}
    claimed: set[int] = set()
    for root in layout.roots:
        for sub in reversed(list(root.modules())):  # every module after those nested in it
            if isinstance(sub, FSDPModule) and id(sub) not in counts:
                owned = [p for p in sub.parameters() if id(p) not in claimed]
                claimed.update(id(p) for p in owned)
                mesh = compat.fsdp_mesh(sub)
                counts[id(sub)] = sum(_gathered_numel(p, mesh.ndim) for p in owned) if mesh is not None else 0
    return [counts[id(unit)] for unit in (*layout.units, *layout.roots)]


def _gathered_numel(param: torch.Tensor, fsdp_ndim: int) -> int:
    """How many values of a sharded ``param`` its unit's all-gather yields on this rank: whole over the FSDP mesh's
    axes (the first ``fsdp_ndim`` of its DTensor's mesh: FSDP2 puts them first), this rank's part along each later
    axis that cuts it (tensor parallelism, whose cuts are even: :mod:`~lightning_ciuic.parallel.tensor`)."""
    if not isinstance(param, DTensor):
        return param.numel()
    mesh = param.device_mesh
    cuts = math.prod(mesh.size(axis) for axis in range(fsdp_ndim, mesh.ndim) if param.placements[axis].is_shard())
    return param.numel() // cuts


def _param_dtype(module: Optional[nn.Module]) -> torch.dtype:
    assert module is not None
    return next((p.dtype for p in module.parameters()), torch.float32)
