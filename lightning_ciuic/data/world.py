"""The data-parallel world that loaders must split their data over, and the loaders pointed at it.

Contract:

* Under :class:`~lightning_ciuic.strategies.hybrid.HybridParallelStrategy` the ranks of one data-parallel replica
  (its tensor-parallel peers, its pipeline stages, expert-parallel peers among the tp peers) must train on the same
  batch, and the replicas on disjoint shares of the global batch. A loader must therefore split its data by the
  *data-parallel* rank and size, never by ``torch.distributed``'s global rank and world size.
* :func:`data_parallel_world` is that world in this process: what the strategy registered with
  :func:`set_data_parallel_world` once its mesh exists, else ``torch.distributed``'s (rank, world size), else
  ``(0, 1)``. A dataset that splits itself reads it in ``__iter__`` (the training process; DataLoader workers of the
  ``fork`` start method inherit it) or implements the hook below.
* :func:`point_loader` (the strategy calls it on every loader Lightning hands it, before the first batch is read)
  makes the loaders it can reach split by the data-parallel world, in place, and describes the loader
  (:class:`LoaderReport`, used by the equal-batch check's messages):

  - LitData ``StreamingDataset`` (also each one inside a ``CombinedStreamingDataset`` / ``ParallelStreamingDataset``):
    its distributed environment becomes (dp size, dp rank); the loader's ``load_state_dict`` then sees the same
    world, so a resume is exact in the same data-parallel size (any tp or pp) and goes through LitData's own elastic
    re-striping in another one, which starts at the last whole global batch before the saved position: where that
    repeats samples, rank 0 warns at the restore, saying how many and what would avoid it. Restored into another
    size, the state's ``drop_last`` becomes the dataset's (LitData's default follows the world size, and LitData
    refuses a state whose ``drop_last`` differs: two replicas to one, an elastic node lost, would fail). Re-striped,
    the loader's ``resume_batch`` says the batch of the epoch it continues at in this world (data/resume.py), where the
    strategy moves the epoch's batch counters.
  - a ``DistributedSampler`` the user built (as the loader's sampler or its batch sampler's), over the global world:
    re-pointed to the data-parallel world (its sample counts recomputed as torch does). One built over any other
    world is left as it is.
  - a dataset (or loader) with a method ``set_data_parallel(rank, size)``: called with the data-parallel rank and size.
  - torchdata's ``StatefulDataLoader``: its sampler and dataset as any DataLoader's (above); its state carries the
    data-parallel size, and a resume into another one is converted or refused (:mod:`lightning_ciuic.data.stateful`).

  A map-style loader without a distributed sampler is Lightning's business (``distributed_sampler_kwargs``, already
  the data-parallel world). Any other ``IterableDataset`` is out of reach: the equal-batch check catches it.

No Lightning imports.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset

from lightning_ciuic import compat
from lightning_ciuic.data.resume import RESUME_BATCH
from lightning_ciuic.data.stateful import is_stateful_loader, point_stateful

HOOK = "set_data_parallel"


@dataclass(frozen=True)
class DataParallelWorld:
    """This process's data-parallel ``rank`` among ``size`` replicas."""

    rank: int
    size: int


_registered: Optional[DataParallelWorld] = None


def set_data_parallel_world(world: Optional[DataParallelWorld]) -> None:
    """Register (``None``: forget) the data-parallel world of this process; the strategy's call."""
    global _registered
    _registered = world


def data_parallel_world() -> DataParallelWorld:
    """The data-parallel rank and size a loader must split its data by (see the module docstring)."""
    if _registered is not None:
        return _registered
    if dist.is_available() and dist.is_initialized():
        return DataParallelWorld(dist.get_rank(), dist.get_world_size())
    return DataParallelWorld(0, 1)


@dataclass
class LoaderReport:
    """What a loader is and what :func:`point_loader` did to it. ``kind``: ``"litdata"``, ``"sampler"`` (a
    distributed sampler, the user's or Lightning's), ``"hook"`` (``set_data_parallel`` called), ``"iterable"`` (an
    ``IterableDataset`` out of reach) or ``"map"`` (map-style, no distributed sampler)."""

    description: str
    kind: str
    notes: list[str] = field(default_factory=list)


def point_loader(loader: Any, world: DataParallelWorld, global_world: DataParallelWorld) -> LoaderReport:
    """Point ``loader`` at the data-parallel ``world`` where it can be reached (see the module docstring)."""
    dataset = getattr(loader, "dataset", None)
    report = LoaderReport(_describe(loader, dataset), "map")
    streaming = _litdata_datasets(dataset)
    if streaming:
        _point_litdata(loader, streaming, world, report)
        return report
    for sampler in _distributed_samplers(loader):
        report.kind = "sampler"
        if (sampler.num_replicas, sampler.rank) == (world.size, world.rank) or global_world == world:
            continue
        if (sampler.num_replicas, sampler.rank) != (global_world.size, global_world.rank):
            report.notes.append(
                f"its {type(sampler).__name__} was built over {sampler.num_replicas} replicas (rank {sampler.rank}),"
                f" neither the data-parallel world ({world.size}) nor the global one ({global_world.size}): left as it is"
            )
            continue
        _repoint_sampler(sampler, world)
        report.notes.append(
            f"its {type(sampler).__name__}, built over the global world ({global_world.size} ranks), now splits over"
            f" the {world.size} data-parallel replicas"
        )
    if is_stateful_loader(loader):
        point_stateful(loader, world.size, _distributed_samplers(loader))
    for target in (dataset, loader):
        hook = getattr(target, HOOK, None)
        if callable(hook):
            hook(world.rank, world.size)
            report.kind = "hook"
            report.notes.append(f"{type(target).__name__}.{HOOK}({world.rank}, {world.size}) was called")
            return report
    if isinstance(dataset, IterableDataset):
        report.kind = "iterable"
    return report


def _describe(loader: Any, dataset: Any) -> str:
    name = type(loader).__name__
    if dataset is None:
        return f"the {name}"
    kind = "an IterableDataset" if isinstance(dataset, IterableDataset) else "a map-style dataset"
    return f"the {name} over {type(dataset).__name__} ({kind})"


def _litdata_datasets(dataset: Any) -> list[Any]:
    """The LitData ``StreamingDataset`` s in ``dataset`` (itself, or a combined/parallel one's), else ``[]``."""
    if dataset is None or "litdata" not in sys.modules:  # not imported: no dataset of it here
        return []
    from litdata import StreamingDataset

    if isinstance(dataset, StreamingDataset):
        return [dataset]
    return [d for child in compat.litdata_children(dataset) for d in _litdata_datasets(child)]


def _point_litdata(loader: Any, datasets: list[Any], world: DataParallelWorld, report: LoaderReport) -> None:
    report.kind = "litdata"
    env = None
    for dataset in datasets:
        nodes = int(getattr(dataset.distributed_env, "num_nodes", 1) or 1)
        nodes = nodes if world.size % nodes == 0 else 1  # the replicas' nodes (tp peers are neighbours on a node)
        env = compat.litdata_distributed_env(world.size, world.rank, nodes)
        before = compat.set_litdata_world(dataset, env)
        if (before.world_size, before.global_rank) != (world.size, world.rank):
            report.notes.append(
                f"its {type(dataset).__name__} split over {before.world_size} ranks (this one {before.global_rank}),"
                f" now over the {world.size} data-parallel replicas (this one {world.rank})"
            )
    load_state_dict = getattr(loader, "load_state_dict", None)
    if env is not None and callable(load_state_dict) and not getattr(load_state_dict, "_data_parallel_world", False):

        def load_in_world(state: dict[str, Any], _original: Any = load_state_dict, _env: Any = env) -> None:
            batch_size = getattr(loader, "batch_size", None)
            _tell_restriping(state, world, batch_size)
            state = _drop_last_of_this_world(state, datasets, world)
            with compat.litdata_detects(_env):  # it compares the saved world size with the one it detects
                _original(state)
            resumed = _restriped_batch(state, world, batch_size)
            if resumed is not None:
                setattr(loader, RESUME_BATCH, resumed)

        load_in_world._data_parallel_world = True  # type: ignore[attr-defined]
        loader.load_state_dict = load_in_world


def _drop_last_of_this_world(state: Any, datasets: list[Any], world: DataParallelWorld) -> Any:
    """``state`` with each dataset's ``drop_last`` this dataset's where it was saved over another number of replicas.

    LitData's default ``drop_last`` follows the world it is built in (True on several ranks, False on one) and its
    ``load_state_dict`` refuses a state whose ``drop_last`` differs: a stream saved on two replicas could not resume
    on one (an elastic node lost). The new world's samples are dealt out afresh from the saved position (LitData's
    re-striping), so its own ``drop_last`` is the one that applies."""
    saved = state.get("dataset") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        return state
    nested = "drop_last" not in saved  # a CombinedStreamingDataset / ParallelStreamingDataset: one state per dataset
    entries = {str(i): saved.get(str(i)) for i in range(len(datasets))} if nested else {"": saved}
    changed = dict(saved)
    for dataset, (key, entry) in zip(datasets, entries.items()):
        if not isinstance(entry, dict) or entry.get("world_size", world.size) == world.size:
            continue
        if "drop_last" in entry and entry["drop_last"] != dataset.drop_last:
            entry = {**entry, "drop_last": dataset.drop_last}
            if nested:
                changed[key] = entry
            else:
                changed = entry
    return {**state, "dataset": changed} if changed != saved else state


def _restriped_batch(state: Any, world: DataParallelWorld, batch_size: Any) -> Optional[int]:
    """The batch of the running epoch at which LitData's elastic re-striping resumes a stream ``state`` saved over
    another number of replicas (or itself so resumed): the whole global batches of this world before the saved sample,
    as LitData rounds; ``None`` where it resumes as saved (:mod:`~lightning_ciuic.data.resume`, ``resume_batch``)."""
    saved = state.get("dataset") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or "sample_in_epoch" not in saved or not isinstance(batch_size, int):
        return None
    if int(saved.get("world_size", world.size)) == world.size and saved.get("resume_mode") != "elastic":
        return None
    return int(saved["sample_in_epoch"]) // (world.size * batch_size)


def _tell_restriping(state: dict[str, Any], world: DataParallelWorld, batch_size: Any) -> None:
    """LitData resumes a stream saved over another number of replicas at the last whole global batch before the saved
    position (its elastic re-striping): say, once, how many samples are trained again and what would avoid it."""
    saved = state.get("dataset") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or "sample_in_epoch" not in saved or not isinstance(batch_size, int):
        return
    before, done = int(saved.get("world_size", world.size)), int(saved["sample_in_epoch"])
    stride = world.size * batch_size
    if before == world.size or done % stride == 0 or (dist.is_initialized() and dist.get_rank() != 0):
        return
    warnings.warn(
        f"Resuming a LitData stream saved over {before} data-parallel replicas on {world.size}: it continues at sample"
        f" {done - done % stride} of the epoch (a whole global batch of {world.size} x {batch_size}), so the last"
        f" {done % stride} samples before the checkpoint are trained again. A checkpoint taken after a multiple of"
        f" {stride} samples of the epoch, or resuming on {before} replicas, resumes with none repeated.",
        stacklevel=2,
    )


def _distributed_samplers(loader: Any) -> list[DistributedSampler]:
    found: list[DistributedSampler] = []
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, DistributedSampler) and all(sampler is not s for s in found):
            found.append(sampler)
    return found


def _repoint_sampler(sampler: DistributedSampler, world: DataParallelWorld) -> None:
    """``sampler`` over ``world``, its counts as ``DistributedSampler.__init__`` computes them."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.drop_last and n % world.size != 0:
        num_samples = math.ceil((n - world.size) / world.size)
    else:
        num_samples = math.ceil(n / world.size)
    sampler.num_replicas, sampler.rank = world.size, world.rank
    sampler.num_samples, sampler.total_size = num_samples, num_samples * world.size
