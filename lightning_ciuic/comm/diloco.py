"""DiLoCo: data-parallel replicas that synchronise rarely (Douillard et al. 2023; Streaming DiLoCo's fragments).

Contract (:class:`DiLoCo` is the configuration users pass; :class:`DiLoCoEngine` the
:class:`~lightning_ciuic.comm.data_parallel.DataParallel` engine the strategy drives):

* Every data-parallel replica runs the user's optimizer alone: backward passes synchronise nothing (``no_sync``
  and ``after_backward`` do nothing). Every ``sync_every`` optimizer steps, right after the inner step, the
  replicas average their *pseudo-gradients* (the parameters at the start of the round minus the current ones)
  and an outer optimizer (torch's SGD, Nesterov momentum: ``outer_lr``, ``outer_momentum``) applies the average to
  the start-of-round parameters; every replica then continues from the result, which starts the next round.
* ``fragments=K`` (Streaming DiLoCo): the parameters, laid end to end in registration order, are cut into K
  contiguous runs of equal length (:func:`split_fragments`; a parameter may span two fragments), each with its own
  round, staggered by ``sync_every / K`` steps, so one sync moves 1/K of the model whatever the sizes of its
  tensors.
* ``overlap_steps=τ`` (Streaming DiLoCo): a fragment's averaging is launched at the end of its round (on the reducer's
  worker thread) and the replicas keep training; after the τ-th inner step since, it is waited for, the outer
  optimizer steps, and the local fragment becomes ``merge_alpha * local + (1 - merge_alpha) * global`` (the steps
  taken meanwhile are kept in part; ``merge_alpha=0`` drops them). The next round starts from the global values.
  With ``τ=0`` the sync blocks and the global values replace the local ones (no local step was taken since).
* ``compression``: ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"nf4"`` for the averaged pseudo-gradients,
  through the replicated engine's reducer (:class:`~lightning_ciuic.comm.compression.GradientCompression`, on any
  device), with error feedback (``error_feedback``).
* At the end of ``fit`` (``finish()``) every fragment with steps since its last sync is synchronised once more, so
  every replica ends with the same model.
* ``setup(module, groups, stages)``: every :class:`~lightning_ciuic.comm.reduction.ReductionGroup` must span the
  same data-parallel ranks (a replica holds all its experts); the trainable parameters of all groups, in the
  module's registration order, are the ones synchronised.
* Parameters are this rank's local shards (tensor and pipeline parallelism): the outer step is per shard, the
  data-parallel replicas are the workers.
* ``state_dict()``: per rank, the start-of-round parameters, the outer momentum, the compression residuals, and
  this replica's current parameters and inner optimizer state (``track_optimizers``): replicas differ inside a
  round, and a checkpoint's model and optimizer hold the first replica's (``replicas_differ`` makes the strategy
  save replicated tensors from the lowest rank, so they are one consistent replica). A run resumed mid-round in
  the same layout continues exactly; without this state (another world size) a new round starts from the loaded
  model.
* ``stats``: outer syncs launched (one collective per fragment sync), bytes this rank sent, seconds they took.
* :func:`~lightning_ciuic.comm.auto.predicted_diloco_step_seconds` predicts a per-step run's step under DiLoCo,
  for the advisor and ``communication_compression="auto"``'s report (neither switches to it: it changes the
  optimisation).

No Lightning imports.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.comm.compression import GradientCompression
from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.comm.groups import close_group, side_copy
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.comm.reduction import ReductionGroup
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.timeline import timeline
from lightning_ciuic.validation import check_choice, check_int
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.wire.replicas import broadcast_from_first

OUTER_COMPRESSION = ("none", "fp16", "bf16", "int8", "nf4")


@dataclass(frozen=True)
class DiLoCo:
    """Low-communication data parallelism for ``HybridParallelStrategy(diloco=DiLoCo(...))`` (module docstring)."""

    sync_every: int = 32
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    compression: str = "none"
    error_feedback: bool = True
    overlap_steps: int = 0
    merge_alpha: float = 0.5

    def __post_init__(self) -> None:
        check_int("sync_every", self.sync_every, note="inner optimizer steps per round")
        check_int("fragments", self.fragments)
        check_int("overlap_steps", self.overlap_steps, minimum=0, note="inner steps a fragment's sync overlaps")
        if self.overlap_steps >= self.sync_every:
            raise ValueError(
                f"overlap_steps={self.overlap_steps} must be below sync_every={self.sync_every}: a fragment's sync must"
                f" land before its next round ends; use overlap_steps <= {self.sync_every - 1}."
            )
        if not 0 <= self.merge_alpha < 1:
            raise ValueError(f"merge_alpha must be in [0, 1) (the local share kept when an overlapped sync lands), got {self.merge_alpha}.")
        if self.fragments > self.sync_every:
            raise ValueError(
                f"fragments={self.fragments} must not exceed sync_every={self.sync_every}: the fragments' rounds are"
                f" staggered by sync_every / fragments steps; use fragments <= {self.sync_every}."
            )
        if not 0 < self.outer_lr:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}.")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}.")
        check_choice("compression", self.compression, OUTER_COMPRESSION)


def _one_mesh(groups: Sequence[ReductionGroup]) -> DeviceMesh:
    """The data-parallel mesh every group averages over: DiLoCo's workers are whole replicas, each holding all of its
    parameters (experts too: ``expert_parallel_size == tensor_parallel_size``), so every group spans the same ranks."""
    if not groups:
        raise ValueError("DiLoCoEngine.setup needs at least one ReductionGroup (the model's dense parameters first).")
    ranks = {group.name: dist.get_process_group_ranks(group.mesh.get_group()) for group in groups}
    first = groups[0]
    apart = {name: r for name, r in ranks.items() if r != ranks[first.name]}
    if apart:
        raise ValueError(
            f"DiLoCo averages whole replicas over one data-parallel group, ranks {ranks[first.name]} ({first.name!r});"
            f" the groups {apart} reduce over other ranks. Keep each replica's experts inside it"
            " (expert_parallel_size == tensor_parallel_size), or drop diloco."
        )
    return first.mesh


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of parameter ``param``, flattened."""

    param: int
    start: int
    length: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of ``tensor`` (a contiguous tensor of the parameter's shape): a flat view, written through."""
        return tensor.view(-1)[self.start : self.start + self.length]


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[Piece]]:
    """Tensors of ``sizes`` elements laid end to end, cut into ``fragments`` contiguous runs of equal length (the
    later ones one longer where the total does not divide): each run as the pieces of tensors it covers, in order.
    Every element is in exactly one piece; a run is never empty while there are at least as many elements."""
    total = sum(sizes)
    bounds = [total * k // fragments for k in range(fragments + 1)]
    firsts = [0, *itertools.accumulate(sizes)][:-1]  # where each tensor starts
    runs = []
    for low, high in zip(bounds, bounds[1:]):
        pieces = [
            Piece(i, max(low, first) - first, min(high, first + size) - max(low, first))
            for i, (first, size) in enumerate(zip(firsts, sizes))
            if max(low, first) < min(high, first + size)
        ]
        if pieces:
            runs.append(pieces)
    return runs


class DiLoCoEngine(DataParallel):
    """Replicas that average pseudo-gradients every ``sync_every`` steps (see the module docstring)."""

    replicas_differ = True

    def __init__(self, config: DiLoCo = DiLoCo()) -> None:
        self.config = config
        self.optimizers: list[torch.optim.Optimizer] = []
        self._stats = SyncStats()
        self.params: list[nn.Parameter] = []
        self.fragments: list[list[Piece]] = []
        self.start: list[torch.Tensor] = []  # start-of-round values, local shards
        self.outer: list[torch.optim.SGD] = []  # one per fragment, over its pieces of the start tensors
        self.compression: Optional[GradientCompression] = None
        self._global_step = 0
        self._last_sync: list[int] = []  # per fragment: the optimizer step count at its last sync
        self._in_flight: dict[int, tuple[Future, torch.Tensor, int, float]] = {}  # fragment -> (sent, average, launched at, t0)
        self._sync_group: Optional[dist.ProcessGroup] = None
        self._fresh = True  # start-of-round values still to take from the model (after set-up or a plain load)

    def setup(self, module: nn.Module, groups: Sequence[ReductionGroup], stages: Sequence[nn.Module] = ()) -> None:
        self.close()
        mesh = _one_mesh(groups)
        self.group = mesh.get_group()
        broadcast_from_first(module, mesh)
        grouped = {id(p) for group in groups for p in group.parameters}
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad and id(p) in grouped]
        for name, p in trainable:
            if not local_tensor(p).is_contiguous():
                raise ValueError(f"DiLoCo reads and writes parameters as flat views; {name} is not contiguous.")
        self.params = [p for _, p in trainable]
        self.fragments = split_fragments([local_tensor(p).numel() for p in self.params], self.config.fragments)
        self.compression = GradientCompression(self.config.compression, error_feedback=self.config.error_feedback)
        # Overlapped syncs run on the reducer's thread while training may use the dp group (a callback's gather, a
        # vote): they get a group of their own, so each group's collectives keep one order on every rank.
        self._sync_group = side_copy(self.group) if self.config.overlap_steps else self.group
        self._fresh = True

    # -- rounds ------------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Take the start-of-round values from the model: after set-up, or after a load without engine state."""
        with torch.no_grad():
            self.start = [local_tensor(p).detach().clone() for p in self.params]
        self.outer = self._outer_optimizers()
        self._last_sync = [self._global_step] * len(self.fragments)
        self._fresh = False

    def _outer_optimizers(self) -> list[torch.optim.SGD]:
        """One outer optimizer per fragment, over its pieces of the start-of-round tensors (views: its steps write
        the start tensors)."""
        momentum = self.config.outer_momentum
        return [
            torch.optim.SGD(
                [piece.of(self.start[piece.param]) for piece in fragment], lr=self.config.outer_lr, momentum=momentum,
                nesterov=momentum > 0,
            )
            for fragment in self.fragments
        ]

    def _offset(self, fragment: int) -> int:
        return fragment * self.config.sync_every // len(self.fragments)

    def before_step(self, global_step: int) -> list[str]:
        self._global_step = global_step
        if self._fresh:
            self._begin()
        return []

    def after_optimizer_step(self) -> None:
        """After the inner optimizer step of ``global_step``: land each sync due now, launch each fragment whose
        round ends here (and land it at once without overlap)."""
        done = self._global_step + 1
        for k, (_, _, launched, _) in sorted(self._in_flight.items()):
            if done - launched >= self.config.overlap_steps:
                self._land(k)
        for k in range(len(self.fragments)):
            if (done - self._offset(k)) % self.config.sync_every == 0 and done > self._last_sync[k]:
                self._launch(k, done)
                if self.config.overlap_steps == 0:
                    self._land(k)

    def finish(self) -> None:
        for k in sorted(self._in_flight):
            self._land(k, keep=0.0)  # the run ends: every replica ends with the global values
        for k in range(len(self.fragments)):
            if not self._fresh and self._global_step + 1 > self._last_sync[k]:
                self._launch(k, self._global_step + 1)
                self._land(k)

    @torch.no_grad()
    def _launch(self, k: int, done: int) -> None:
        """Start averaging fragment ``k``'s pseudo-gradient on the reducer's thread; training goes on meanwhile."""
        assert self.compression is not None and self.group is not None
        pseudo = torch.cat([piece.of(self.start[piece.param]) - self._local(piece) for piece in self.fragments[k]])
        sent = self.compression.submit(f"fragment{k}", pseudo, [pseudo.shape], self._sync_group)  # averages in place
        self._in_flight[k] = (sent, pseudo, done, time.perf_counter())
        self._last_sync[k] = done

    @torch.no_grad()
    def _land(self, k: int, keep: Optional[float] = None) -> None:
        """Wait for fragment ``k``'s average, take the outer step, merge the global values into the local ones (the
        local share ``keep``: ``merge_alpha`` after an overlap, else 0)."""
        sent, pseudo, _, launched_at = self._in_flight.pop(k)
        waited_from = time.perf_counter()
        sent_bytes = sent.result()
        outer = self.outer[k]
        starts = outer.param_groups[0]["params"]  # the fragment's pieces of the start tensors
        for start, average in zip(starts, pseudo.split([t.numel() for t in starts])):
            start.grad = average
        outer.step()
        if keep is None:
            keep = self.config.merge_alpha if self.config.overlap_steps else 0.0
        for piece, start in zip(self.fragments[k], starts):
            start.grad = None
            self._local(piece).lerp_(start, 1.0 - keep)  # keep * local + (1 - keep) * global
        now = time.perf_counter()
        self._stats.collectives += 1
        self._stats.bytes_sent += sent_bytes
        self._stats.bytes_reduced += pseudo.numel() * 4
        self._stats.add_comm(now - launched_at)  # launch to landing
        self._stats.add_wait(now - waited_from)  # what training waited for
        timeline.record(f"outer sync (fragment {k})", "outer_sync", waited_from, now)
        if self.config.overlap_steps:
            timeline.record(f"outer sync in flight (fragment {k})", Axis.DP, launched_at, now, track="dp collectives")

    def _local(self, piece: Piece) -> torch.Tensor:
        """``piece`` of this rank's parameter (its local shard): a view, written through."""
        return piece.of(local_tensor(self.params[piece.param]).data)

    def track_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    # -- the interface's other points -----------------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # inner steps never synchronise

    def after_backward(self, accumulated: bool = False) -> None:
        pass

    @property
    def stats(self) -> SyncStats:
        return self._stats

    def payload(self) -> tuple[int, int]:
        return sum(p.numel() for p in self.params), len(self.fragments)

    has_rank_state = True

    @property
    def label(self) -> str:
        return f"diloco-{self.config.compression}"

    def describe(self) -> dict[str, Any]:
        return {"mode": self.label, "sync_every": self.config.sync_every, "fragments": len(self.fragments)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._fresh:
            return {}
        for sent, _, _, _ in self._in_flight.values():  # saved averaged: a resumed run lands it on time
            sent.result()
        state = {f"start.{i}": t for i, t in enumerate(self.start)}
        for k, (_, average, launched, _) in self._in_flight.items():
            state[f"in_flight.{k}.average"] = average
            state[f"in_flight.{k}.launched"] = torch.tensor(float(launched))  # a host scalar, read back with int()
        state.update({f"current.{i}": local_tensor(p).detach() for i, p in enumerate(self.params)})
        for k, optimizer in enumerate(self.outer):
            for j, tensor in enumerate(optimizer.param_groups[0]["params"]):
                buffer = optimizer.state.get(tensor, {}).get("momentum_buffer")
                if buffer is not None:
                    state[f"momentum.{k}.{j}"] = buffer
        # Step counters: host scalars on purpose (read back with int(), never computed with).
        state.update({f"last_sync.{k}": torch.tensor(float(s)) for k, s in enumerate(self._last_sync)})
        for o, optimizer in enumerate(self.optimizers):  # this replica's inner state (Adam's moments, step)
            for i, p in enumerate(self.params):
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[f"inner.{o}.{i}.{key}"] = value
        assert self.compression is not None
        state.update(self.compression.state_dict())  # "residual.<fragment>"
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not any(key.startswith("start.") for key in state):
            self._fresh = True  # nothing saved for this rank: a new round from the loaded model, no residuals
            if self.compression is not None:
                self.compression.load_state_dict({})
            return
        for i, p in enumerate(self.params):
            local_tensor(p).copy_(state[f"current.{i}"])
        self.start = [state[f"start.{i}"].to(local_tensor(p)).clone() for i, p in enumerate(self.params)]  # device, dtype
        self.outer = self._outer_optimizers()
        for k, optimizer in enumerate(self.outer):
            for j, tensor in enumerate(optimizer.param_groups[0]["params"]):
                buffer = state.get(f"momentum.{k}.{j}")
                if buffer is not None:
                    if buffer.shape != tensor.shape:
                        raise ValueError(
                            f"DiLoCo state: fragment {k}'s outer momentum {j} has shape {tuple(buffer.shape)}, this run's"
                            f" piece {tuple(tensor.shape)}: it was saved with another fragment layout (another"
                            f" `fragments`, or the whole-parameter split of earlier versions); resume with the same"
                            f" `fragments`, or load the checkpoint without DiLoCo state (a new round starts)."
                        )
                    optimizer.state[tensor]["momentum_buffer"] = buffer.to(tensor).clone()
        self._last_sync = [int(state[f"last_sync.{k}"]) for k in range(len(self.fragments))]
        self._in_flight = {}
        for k in range(len(self.fragments)):
            if f"in_flight.{k}.average" in state:
                landed: Future = Future()
                landed.set_result(0)  # its bytes were counted by the run that sent them
                average = state[f"in_flight.{k}.average"].to(self.start[self.fragments[k][0].param]).clone()
                self._in_flight[k] = (landed, average, int(state[f"in_flight.{k}.launched"]), time.perf_counter())
        for o, optimizer in enumerate(self.optimizers):
            for i, p in enumerate(self.params):
                for key in [k.rsplit(".", 1)[1] for k in state if k.startswith(f"inner.{o}.{i}.")]:
                    saved = state[f"inner.{o}.{i}.{key}"]
                    held = optimizer.state[p].get(key)
                    optimizer.state[p][key] = saved.to(held).clone() if isinstance(held, torch.Tensor) else saved.clone()
        assert self.compression is not None
        self.compression.load_state_dict(state)  # takes its "residual." entries
        self._fresh = False

    def buffer_bytes(self) -> int:
        """The round's start copy of every parameter and, from the first outer step, the outer momentum of the same size."""
        start = sum(t.numel() * t.element_size() for t in self.start)
        return start * (2 if self.config.outer_momentum > 0 else 1)

    def close(self) -> None:
        for sent, _, _, _ in self._in_flight.values():
            sent.result()  # never leave the reducer's thread inside a collective
        if self._sync_group is not None and self._sync_group is not self.group:
            close_group(self._sync_group)
        self._sync_group = None
        self.params, self.fragments, self.start, self.outer, self._last_sync, self._in_flight = [], [], [], [], [], {}
        self._fresh = True
