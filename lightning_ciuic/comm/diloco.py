"""DiLoCo: data-parallel replicas that synchronise rarely (Douillard et al. 2023; Streaming DiLoCo's fragments).

Contract (:class:`DiLoCo` is the configuration users pass; :class:`DiLoCoEngine` the
:class:`~lightning_ciuic.comm.data_parallel.DataParallel` engine the strategy drives):

* Every data-parallel replica runs the user's optimizer alone: backward passes synchronise nothing (``no_sync``
  and ``after_backward`` do nothing). Every ``sync_every`` optimizer steps, right after the inner step, the
  replicas average their *pseudo-gradients* (the parameters at the start of the round minus the current ones)
  and an outer optimizer (torch's SGD, Nesterov momentum: ``outer_lr``, ``outer_momentum``) applies the average to
  the start-of-round parameters; every replica then continues from the result, which starts the next round.
* ``fragments=K`` (Streaming DiLoCo): the parameters are cut into K contiguous fragments of about equal size,
  each with its own round, staggered by ``sync_every / K`` steps, so one sync moves about 1/K of the model.
* ``compression``: ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"nf4"`` for the averaged pseudo-gradients,
  through the replicated engine's reducer (:class:`~lightning_ciuic.comm.compression.GradientCompression`, on any
  device), with error feedback (``error_feedback``).
* At the end of ``fit`` (``finish()``) every fragment with steps since its last sync is synchronised once more, so
  every replica ends with the same model.
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

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.comm.compression import GradientCompression
from lightning_ciuic.comm.data_parallel import DataParallel, broadcast_from_first
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.timeline import timeline
from lightning_ciuic.validation import check_choice, check_int

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

    def __post_init__(self) -> None:
        check_int("sync_every", self.sync_every, note="inner optimizer steps per round")
        check_int("fragments", self.fragments)
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


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into ``fragments`` contiguous groups of about equal total (none empty while there
    are at least as many entries)."""
    total, groups, current, filled = sum(sizes), [], [], 0
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        remaining_groups = fragments - len(groups) - 1
        if remaining_groups and (filled >= total * (len(groups) + 1) / fragments or len(sizes) - index - 1 == remaining_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return [g for g in groups if g]


class DiLoCoEngine(DataParallel):
    """Replicas that average pseudo-gradients every ``sync_every`` steps (see the module docstring)."""

    replicas_differ = True

    def __init__(self, config: DiLoCo = DiLoCo()) -> None:
        self.config = config
        self.optimizers: list[torch.optim.Optimizer] = []
        self._stats = SyncStats()
        self.params: list[nn.Parameter] = []
        self.fragments: list[list[int]] = []
        self.start: list[torch.Tensor] = []  # start-of-round values, local shards
        self.outer: list[torch.optim.SGD] = []  # one per fragment, over its start tensors
        self.compression: Optional[GradientCompression] = None
        self._global_step = 0
        self._last_sync: list[int] = []  # per fragment: the optimizer step count at its last sync
        self._fresh = True  # start-of-round values still to take from the model (after set-up or a plain load)

    def setup(self, module: nn.Module, mesh: DeviceMesh, stages: Sequence[nn.Module] = ()) -> None:
        self.close()
        self.group = mesh.get_group()
        broadcast_from_first(module, mesh)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.fragments = split_fragments([p.numel() for p in self.params], self.config.fragments)
        self.compression = GradientCompression(self.config.compression, error_feedback=self.config.error_feedback)
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
        """One outer optimizer per fragment, over its start-of-round tensors."""
        momentum = self.config.outer_momentum
        return [
            torch.optim.SGD([self.start[i] for i in fragment], lr=self.config.outer_lr, momentum=momentum, nesterov=momentum > 0)
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
        """After the inner optimizer step of ``global_step``: sync each fragment whose round ends here."""
        done = self._global_step + 1
        for k in range(len(self.fragments)):
            if (done - self._offset(k)) % self.config.sync_every == 0 and done > self._last_sync[k]:
                self._sync(k, done)

    def finish(self) -> None:
        for k in range(len(self.fragments)):
            if not self._fresh and self._global_step + 1 > self._last_sync[k]:
                self._sync(k, self._global_step + 1)

    @torch.no_grad()
    def _sync(self, k: int, done: int) -> None:
        assert self.compression is not None and self.group is not None
        started = time.perf_counter()
        indices = self.fragments[k]
        current = [local_tensor(self.params[i]) for i in indices]
        pseudo = torch.cat([(self.start[i] - c).reshape(-1) for i, c in zip(indices, current)])
        sent = self.compression.submit(f"fragment{k}", pseudo, [pseudo.shape], self.group).result()  # averaged in place
        for i, piece in zip(indices, pseudo.split([self.start[i].numel() for i in indices])):
            self.start[i].grad = piece.view_as(self.start[i])
        self.outer[k].step()
        for i, c in zip(indices, current):
            self.start[i].grad = None
            c.copy_(self.start[i])
        self._last_sync[k] = done
        self._stats.collectives += 1
        self._stats.bytes_sent += sent
        self._stats.bytes_reduced += pseudo.numel() * 4
        elapsed = time.perf_counter() - started  # blocking: all of it is waited for
        timeline.record(f"outer sync (fragment {k})", "outer_sync", started)
        self._stats.add_comm(elapsed)
        self._stats.add_wait(elapsed)

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

    def describe(self) -> Optional[dict[str, Any]]:
        return {"mode": f"diloco-{self.config.compression}", "sync_every": self.config.sync_every, "fragments": len(self.fragments)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._fresh:
            return {}
        state = {f"start.{i}": t for i, t in enumerate(self.start)}
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
                    optimizer.state[tensor]["momentum_buffer"] = buffer.to(tensor).clone()
        self._last_sync = [int(state[f"last_sync.{k}"]) for k in range(len(self.fragments))]
        for o, optimizer in enumerate(self.optimizers):
            for i, p in enumerate(self.params):
                for key in [k.rsplit(".", 1)[1] for k in state if k.startswith(f"inner.{o}.{i}.")]:
                    saved = state[f"inner.{o}.{i}.{key}"]
                    held = optimizer.state[p].get(key)
                    optimizer.state[p][key] = saved.to(held).clone() if isinstance(held, torch.Tensor) else saved.clone()
        assert self.compression is not None
        self.compression.load_state_dict(state)  # takes its "residual." entries
        self._fresh = False

    def close(self) -> None:
        self.params, self.fragments, self.start, self.outer, self._last_sync = [], [], [], [], []
        self._fresh = True
