"""Sharded: data parallelism that shards the model (torch's FSDP2, ``fully_shard``) over ``dp_shard``, with
replicas of the shards over ``dp_replicate`` (HSDP).

Contract (a :class:`~lightning_ciuic.comm.data_parallel.DataParallel` engine):

* ``setup(module, mesh, stages=(), layout=None)``: the module is already sharded
  (:func:`~lightning_ciuic.parallel.fsdp.shard`, called by :func:`~lightning_ciuic.parallel.parallelize.parallelize`,
  or the user's own ``fully_shard`` calls); ``layout`` is its :class:`~lightning_ciuic.parallel.fsdp.FSDPLayout`
  (default: found in the module, or under pipeline parallelism in this rank's ``stages``). A unit's parameters are
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
* ``no_sync()``: FSDP2's ``set_requires_gradient_sync(False)``: gradients accumulate unreduced (and unsharded)
  until the last micro-batch, whose backward reduce-scatters the sum.
* ``after_backward()``: nothing to wait for: FSDP2 waits for its reduce-scatters at the end of backward. It adds
  the bytes of FSDP2's own all-reduce over ``dp_replicate`` (HSDP), computed for a ring (2 (r-1)/r of the gradient
  shard), not measured, and not timed.
* ``state_dict()``: the quantized reduce-scatters' error-feedback residuals (per rank, saved with checkpoints and
  snapshots like the replicated engine's; ``has_rank_state`` says whether there are any); ``label``: what the
  monitor shows (``"none"``, ``"fp16"``, ``"int8"``, with ``"+ int8 weights"`` for a quantized all-gather).

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_ciuic.comm.codecs import dense_codec
from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.comm.fsdp_comms import AllGatherComm, ReduceScatterComm
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.comm.timing import DeviceClock
from lightning_ciuic.parallel.fsdp import FSDPLayout, ShardingConfig, check_offload, found_sharding
from lightning_ciuic.tensors import device_of


class Sharded(DataParallel):
    """Parameters, gradients and optimizer state sharded over ``dp_shard`` (FSDP2); see the module docstring."""

    def __init__(self, config: ShardingConfig = ShardingConfig()) -> None:
        self.config = config
        self.mesh: Optional[DeviceMesh] = None
        self.module: Optional[nn.Module] = None
        self.roots: list[FSDPModule] = []  # the module, or under pipeline parallelism each stage this rank runs
        self.units: list[nn.Module] = []
        self._stats = SyncStats()
        self._sync = True
        self._unit_numel: list[int] = []  # parameters of each unit, the roots' own last (gathered sizes)
        self._replica_bytes = 0
        self.gradient_comms: list[ReduceScatterComm] = []  # one per unit, the roots' last

    def setup(
        self, module: nn.Module, mesh: DeviceMesh, stages: Sequence[nn.Module] = (), layout: Optional[FSDPLayout] = None
    ) -> None:
        self.close()
        layout = layout or found_sharding(module)
        if layout is None:
            raise ValueError(f"{type(module).__name__} is not sharded: shard it first (parallelize(), or fully_shard).")
        check_offload(self.config.cpu_offload, layout.mesh.device_type)
        self.mesh, self.group = layout.mesh, layout.mesh.get_group(layout.mesh.ndim - 1)
        self.module, self.roots, self.units = module, layout.roots, layout.units  # type: ignore[assignment]
        self._unit_numel = list(layout.unit_numel)
        clock = DeviceClock(device_of(layout.mesh))
        gradient_codec = dense_codec(self.config.gradient_codec) if self.config.gradient_codec else None
        gather = AllGatherComm(self._stats, clock, dense_codec(self.config.weight_codec) if self.config.weight_codec else None)
        for unit in (*layout.units, *layout.roots):
            scatter = ReduceScatterComm(self._stats, clock, gradient_codec, self.config.error_feedback)
            unit.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
            unit.set_custom_all_gather(gather)  # type: ignore[operator]
            self.gradient_comms.append(scatter)
        self._replica_bytes = self._replica_traffic()  # derived once: the units and dtypes do not change

    def before_step(self, global_step: int) -> list[str]:
        return []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        for root in self.roots:
            root.set_requires_gradient_sync(False)
        self._sync = False
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True)
            self._sync = True

    def after_backward(self, accumulated: bool = False) -> None:
        if self._sync:
            self._stats.bytes_sent += self._replica_bytes
            self._stats.bytes_reduced += sum(self._unit_numel) * 4

    def _replica_traffic(self) -> int:
        """Bytes this rank sends per synchronized backward in FSDP2's own all-reduce over ``dp_replicate`` (HSDP; a
        ring: 2 (r-1)/r of its gradient shard). The gathers and reduce-scatters count themselves (fsdp_comms)."""
        assert self.mesh is not None
        if self.mesh.ndim == 1:
            return 0
        shard, replicate = self.mesh.size(1), self.mesh.size(0)
        reduce_bytes = (self.config.reduce_dtype or self.config.param_dtype or _param_dtype(self.module)).itemsize
        return int(2 * (sum(self._unit_numel) / shard) * reduce_bytes * (replicate - 1) / replicate)

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


def _param_dtype(module: Optional[nn.Module]) -> torch.dtype:
    assert module is not None
    return next((p.dtype for p in module.parameters()), torch.float32)
