"""Pipeline stages that need no inputs do not read the data.

Contract:

* Under pipeline parallelism the stage that holds the model's first block needs a batch's inputs, the one that holds
  its last block the targets; a *middle* stage (one that holds neither: pp >= 3 with one stage per rank or looped
  virtual stages, every pipeline rank but the first under the V-shaped schedules) needs only the inputs' shape.
* :func:`stage_loader` (the strategy calls it on the training loader, after :func:`~.world.point_loader`) returns the
  loader as it is where the layout has no middle stage (no pipeline, pp 2 with one stage per rank or looped stages):
  nothing is added. Otherwise it wraps the loader of every pipeline rank in a :class:`StageLoader`:

  - the rank holding stage 0 reads its loader and, for every batch it fetches, broadcasts over the pipeline group
    whether it got one and the shape of its inputs (``pipeline_inputs(batch)[0]``): one collective of 10 int64 per
    batch, in the loader's iteration (the same place on every pipeline rank, since Lightning fetches alike);
  - the rank holding the last stage reads its loader too (it needs the targets) and follows the first: it stops
    where the first stage's loader stops, and raises where its own loader ends before the first stage's;
  - a middle rank never iterates its loader (its dataset's ``__iter__`` / ``__getitem__`` are never called): it
    yields one :class:`~lightning_ciuic.parallel.pipeline_module.NotRead` per batch of the first stage, carrying that batch's inputs' shape and size, and stops
    where the first stage's loader stops, so an unsized stream ends on every stage together.

  A replica's data is therefore read by its first and its last pipeline stage (once per pipeline under the V-shaped
  schedules, where one rank holds both), not by every stage. ``len`` and every other attribute (``sampler``,
  ``dataset``, ``state_dict``, ``load_state_dict``, ...) are the wrapped loader's, read and set.
* On a middle stage the training step gets the :class:`NotRead`: ``PipelineModule.pipelined_loss`` runs the schedule
  on it (the stage receives its activations from its neighbour) and gives Lightning the batch size for logging; a
  ``training_step`` or callback may read the batch's shape from it (``batch[0].numel()``), not its values. The
  equal-batch check (:mod:`.check`) compares the ranks that read. Validation, test and predict loaders are read by
  every stage. Under tensor parallelism each tensor-parallel rank of the first (last) stage reads, as before.

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ciuic.parallel.pipeline import stage_ids_of_rank
from lightning_ciuic.parallel.pipeline_module import NotRead

MAX_DIMS = 8  # dimensions of the inputs' shape the first stage can send


def roles(pp_size: int, stages_per_rank: int, schedule: str) -> list[str]:
    """Each pipeline rank's role: ``"first"`` (holds stage 0), ``"last"`` (the last stage, not stage 0) or
    ``"middle"`` (neither)."""
    last = pp_size * stages_per_rank - 1
    found = []
    for rank in range(pp_size):
        ids = stage_ids_of_rank(rank, pp_size, stages_per_rank, schedule)
        found.append("first" if 0 in ids else "last" if last in ids else "middle")
    return found


def stage_loader(loader: Any, runner: Any, module: Any) -> Any:
    """``loader`` for this pipeline rank (see the module docstring); ``runner``: the strategy's
    :class:`~lightning_ciuic.parallel.pipeline.PipelineRunner`, or ``None`` without pipeline parallelism."""
    if runner is None:
        return loader
    pp_size, pp_rank = dist.get_world_size(runner.group), dist.get_rank(runner.group)
    layout = roles(pp_size, len(runner.stage_ids), runner.schedule_name)
    if "middle" not in layout:
        return loader
    return StageLoader(loader, layout[pp_rank], runner.group, runner.device, module)


class StageLoader:
    """A pipeline rank's training loader where the pipeline has middle stages (see the module docstring)."""

    def __init__(self, loader: Any, role: str, group: Any, device: torch.device, module: Any) -> None:
        self.loader, self.role, self.group, self.device, self.module = loader, role, group, device, module
        self.source = dist.get_global_rank(group, 0)  # pipeline rank 0 holds stage 0 under every placement

    def __len__(self) -> int:
        return len(self.loader)  # TypeError for an unsized loader, as Lightning expects

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. worker_init_fn on the loader it holds: the wrapped loader's
        object.__setattr__(self, name, value) if name in _OWN else setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[Any]:
        if self.role == "middle":
            while (shape := self._exchange(None)) is not None:
                yield NotRead(shape)
            return
        batches = iter(self.loader)
        while True:
            batch = next(batches, _END)
            shape = self._exchange(batch)
            if shape is None:
                return  # the first stage's loader ended (the last stage follows it)
            if batch is _END:
                raise RuntimeError(
                    "HybridParallelStrategy: the training loader of the last pipeline stage ended before the first"
                    f" stage's, which still sent a batch of inputs of shape {tuple(shape)}; the stages of a replica"
                    " must read the same batches (see docs/data.md)."
                )
            yield batch

    def _exchange(self, batch: Any) -> Optional[tuple[int, ...]]:
        """Broadcast from the first stage whether it has a batch and its inputs' shape; returns that shape, or
        ``None`` at the end of its loader."""
        values = [0] * (2 + MAX_DIMS)
        if self.role == "first" and batch is not _END:
            shape = tuple(_inputs_shape(self.module, batch))
            if len(shape) > MAX_DIMS:
                raise ValueError(f"pipeline inputs of {len(shape)} dimensions (shape {shape}); at most {MAX_DIMS}.")
            values[: 2 + len(shape)] = [1, len(shape), *shape]
        message = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(message, src=self.source, group=self.group)
        values = message.tolist()
        return tuple(values[2 : 2 + values[1]]) if values[0] else None


_END = object()
_OWN = frozenset({"loader", "role", "group", "device", "module", "source"})


def _inputs_shape(module: Any, batch: Any) -> tuple[int, ...]:
    inputs = module.pipeline_inputs(batch)[0]
    shape = getattr(inputs, "shape", None)
    if shape is None:
        raise TypeError(
            f"pipeline_inputs(batch)[0] is a {type(inputs).__name__}, not a tensor: the pipeline's first stage sends"
            " its shape to the middle stages, which do not read the data."
        )
    return tuple(int(d) for d in shape)
