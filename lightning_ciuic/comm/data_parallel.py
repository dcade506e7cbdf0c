"""Data-parallel engines: the one interface through which a strategy keeps data-parallel replicas in step.

Contract of a :class:`DataParallel` engine, driven by the strategy at four points:

* ``setup(module, groups, stages=())``: after the module is on its device, before the optimizer exists; ``groups``
  are the :class:`~lightning_ciuic.comm.reduction.ReductionGroup` s to average (the model's dense parameters over
  the data-parallel ranks first, then under expert parallelism the experts' over the ranks holding the same experts:
  :func:`~lightning_ciuic.comm.engines.reduction_groups`; :func:`~lightning_ciuic.comm.engines.build_engine` picks
  and sets up the engine); ``stages`` are the pipeline stages this rank runs (sub-module groups of ``module`` that
  torch's pipeline schedule calls directly), empty without pipeline parallelism. The engine makes every replica
  start from the weights of the first rank of each group's mesh and installs what it needs (gradient hooks,
  buckets, reducers; or, sharded, drives the groups' FSDP2 units, with each stage as a root).
* ``before_step(global_step) -> list[str]``: at the start of every training batch (the engine acts once per
  optimizer step); returns messages worth logging once (a decision of ``"auto"``).
* ``no_sync()``: backward passes inside it accumulate locally (gradient accumulation, pipeline micro-batches; an
  engine with ``schedule_syncs`` is entered for accumulation only: torch's pipeline stages hold its micro-batches);
  ``after_backward(accumulated)`` then makes this rank's gradients the replicas' average: overlapped with
  backward when hooks saw the gradients, all at once when they were ``accumulated`` outside the hooks.
* ``state_dict()`` / ``load_state_dict(state)``: this rank's engine state for checkpoints and snapshots (flat
  name -> tensor); ``has_rank_state``: whether there is any (checkpoints then keep it under this rank's key);
  ``describe()`` / ``restore(description)``: the small, rank-independent part (the active mode) saved once;
  ``label``: what the monitor shows as the run's compression.
* ``after_optimizer_step()``: after each optimizer step; ``finish()``: at the end of training (both nothing by
  default: DiLoCo synchronises there); ``track_optimizers(optimizers)`` once they exist; ``replicas_differ``: the
  replicas' tensors are not equal (checkpoints then take replicated tensors from the lowest rank).
* ``stats``: :class:`~lightning_ciuic.comm.grad_sync.SyncStats` counters; ``payload()``: (gradient values
  averaged per optimizer step, collectives launched for them): both added up over every group, so an
  expert-parallel run's expert gradients count in the monitor and the report; ``close()`` detaches everything.
* :func:`engine_state` / :func:`restore_engine_state`: what checkpoints and snapshots keep of an engine (its
  per-rank tensors and its mode, under :data:`ENGINE_STATE_KEY`), and loading it back.

:class:`Replicated` is today's engine: every replica holds the whole model; bucketed, overlapped averaging
(:class:`~lightning_ciuic.comm.grad_sync.GradientSynchronizer`, one per group with more than one rank: a bucket's
codec state is keyed by its group's name after the first group), compressed and error-corrected as a
:class:`~lightning_ciuic.comm.compression.CompressionConfig` says, ``"auto"`` deciding the mode from measured
step times. :class:`~lightning_ciuic.comm.sharded.Sharded` shards the model (FSDP2 over ``dp_shard``, HSDP);
:class:`~lightning_ciuic.comm.diloco.DiLoCoEngine` synchronises every ``sync_every`` steps (DiLoCo).

No Lightning imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ciuic.comm.auto import AutoCompression
from lightning_ciuic.comm.compression import CompressionConfig, GradientCompression
from lightning_ciuic.comm.grad_sync import BucketReducer, GradientSynchronizer, SyncStats, mean_all_reduce
from lightning_ciuic.comm.reduction import ReductionGroup


class DataParallel(ABC):
    """How replicas of a model over a data-parallel group stay in step (see the module docstring)."""

    group: Optional[dist.ProcessGroup] = None
    replicas_differ = False  # True: replicated tensors are not equal across data-parallel ranks (DiLoCo)
    schedule_syncs = False  # True: pipeline stages synchronise their gradients themselves (FSDP2 roots, torch's stage)

    @abstractmethod
    def setup(self, module: torch.nn.Module, groups: Sequence[ReductionGroup], stages: Sequence[torch.nn.Module] = ()) -> None: ...

    @abstractmethod
    def before_step(self, global_step: int) -> list[str]: ...

    @abstractmethod
    def no_sync(self) -> Any: ...

    @abstractmethod
    def after_backward(self, accumulated: bool = False) -> None: ...

    @property
    @abstractmethod
    def stats(self) -> SyncStats: ...

    @abstractmethod
    def payload(self) -> tuple[int, int]: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def buffer_bytes(self) -> int:
        """Bytes of the engine's own tensors held between steps (the replicated engine's gradient buckets)."""
        return 0

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass

    @property
    def has_rank_state(self) -> bool:
        """Whether :meth:`state_dict` holds per-rank state to save (error-feedback residuals, DiLoCo's rounds)."""
        return False

    @property
    def label(self) -> str:
        """The compression the monitor shows for this engine's traffic."""
        return "none"

    def describe(self) -> dict[str, Any]:
        """The rank-independent part of the state that :meth:`restore` reads back."""
        return {}

    def track_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The optimizers built after set-up (an engine whose state includes theirs keeps them)."""

    def after_optimizer_step(self) -> None:
        """After each optimizer step (the replicated and sharded engines did their work during backward)."""

    def finish(self) -> None:
        """At the end of training, before the model is handed back or saved."""

    def restore(self, description: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class Replicated(DataParallel):
    """Whole replicas; each group's gradients averaged in buckets over its mesh during backward, compressed as the
    groups' :class:`~lightning_ciuic.comm.compression.CompressionConfig` says (one reducer for all of them)."""

    def __init__(self, bucket_size_mb: float = 25.0, timeout: float = 300.0) -> None:
        self.bucket_size_mb, self.timeout = bucket_size_mb, timeout
        self.config = CompressionConfig()
        self.synchronizers: dict[str, GradientSynchronizer] = {}  # by group name, the first group's first
        self.compression: Optional[GradientCompression] = None
        self.auto: Optional[AutoCompression] = None
        self._auto_step = -1

    def setup(self, module: torch.nn.Module, groups: Sequence[ReductionGroup], stages: Sequence[torch.nn.Module] = ()) -> None:
        self.close()
        if not groups:
            raise ValueError("Replicated.setup needs at least one ReductionGroup (the model's dense parameters first).")
        configs = {group.compression for group in groups}
        if len(configs) > 1:
            raise ValueError(
                f"the replicated engine reduces every group through one reducer (one worker thread keeps every rank's"
                f" collectives in one order); the groups {[g.name for g in groups]} ask for"
                f" {sorted(c.mode for c in configs)}: give them one CompressionConfig."
            )
        self.config = groups[0].compression
        self.group = groups[0].mesh.get_group()
        self._auto_step = -1
        if not self.config.exact_mean:
            self.compression = GradientCompression.from_config(self.config)
        reduce = self.compression or mean_all_reduce
        for index, group in enumerate(groups):
            if index > 0 and group.mesh.size() == 1:
                continue  # nothing to average (each rank holds its own experts, say)
            synchronizer = GradientSynchronizer(
                group.parameters, group=group.mesh.get_group(), bucket_size_mb=self.bucket_size_mb, timeout=self.timeout,
                axis_name=group.axis, reducer=reduce if index == 0 else _prefixed(reduce, group.name),
            )
            # Like DDP: every replica starts from the weights of the first rank of its group (the buffers: the first's).
            synchronizer.broadcast_parameters([*group.parameters, *(module.buffers() if index == 0 else ())])
            self.synchronizers[group.name] = synchronizer
        if self.config.mode == "auto":
            assert self.compression is not None
            device = self.synchronizer.buckets[0].buffer.device if self.synchronizer.buckets else torch.device("cpu")
            self.auto = AutoCompression(self.compression, self.config.auto_recheck_steps, device=device)

    @property
    def synchronizer(self) -> GradientSynchronizer:
        """The first group's (the model's dense parameters over the data-parallel ranks)."""
        assert self.synchronizers, "the engine is not set up"
        return next(iter(self.synchronizers.values()))

    def before_step(self, global_step: int) -> list[str]:
        """Compression warm-up, and ``"auto"``'s trial and decisions (once per optimizer step)."""
        if self.compression is not None:
            self.compression.set_step(global_step)
        if self.auto is None or global_step == self._auto_step:
            return []
        self._auto_step = global_step
        decision = self.auto.on_step(self.synchronizer.group, global_step, *self.payload())
        return [decision.reason] if decision is not None else []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with ExitStack() as stack:
            for synchronizer in self.synchronizers.values():
                stack.enter_context(synchronizer.no_sync())
            yield

    def after_backward(self, accumulated: bool = False) -> None:
        for synchronizer in self.synchronizers.values():
            if accumulated:
                synchronizer.sync_accumulated()
            else:
                synchronizer.finish()

    @property
    def stats(self) -> SyncStats:
        """Every group's counters added up (the experts' bytes with the dense ones)."""
        return sum((s.stats for s in self.synchronizers.values()), SyncStats())

    def payload(self) -> tuple[int, int]:
        buckets = [bucket for s in self.synchronizers.values() for bucket in s.buckets]
        return sum(bucket.buffer.numel() for bucket in buckets), len(buckets)

    def buffer_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for s in self.synchronizers.values() for b in s.buckets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.compression.state_dict() if self.compression is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.compression is not None:
            self.compression.load_state_dict(state)

    @property
    def has_rank_state(self) -> bool:
        return self.compression is not None

    @property
    def label(self) -> str:
        return self.compression.mode if self.compression is not None else "none"

    def describe(self) -> dict[str, Any]:
        if self.compression is None:
            return {}
        return {"mode": self.compression.mode, "algorithm": self.compression.algorithm}

    def restore(self, description: dict[str, Any]) -> None:
        if self.compression is not None and description:
            self.compression.set_mode(**description)

    def close(self) -> None:
        for synchronizer in self.synchronizers.values():
            synchronizer.remove()
        if self.compression is not None:
            self.compression.close()
        self.synchronizers, self.compression, self.auto = {}, None, None


def _prefixed(reduce: BucketReducer, name: str) -> BucketReducer:
    """``reduce`` with the group's name before each bucket's key (codecs keep per-bucket state by key)."""
    return lambda key, *args: reduce(f"{name}.{key}", *args)


ENGINE_STATE_KEY = "data_parallel"


def engine_state(engine: Optional[DataParallel]) -> Optional[dict[str, Any]]:
    """What a snapshot or checkpoint keeps of the engine: its per-rank tensors and its mode, or None if nothing."""
    if engine is None or not engine.has_rank_state:
        return None
    return {"state": engine.state_dict(), "description": engine.describe()}


def restore_engine_state(engine: DataParallel, saved: Optional[dict[str, Any]]) -> None:
    """Load :func:`engine_state` back; ``None`` (another rank's or layout's, or none kept) starts the engine afresh."""
    engine.load_state_dict(saved["state"] if saved is not None else {})
    if saved is not None:
        engine.restore(saved["description"])
