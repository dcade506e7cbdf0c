"""torchdata's ``StatefulDataLoader`` resumed in the data-parallel world it is restored in.

Contract:

* :func:`point_stateful` (:func:`~lightning_ciuic.data.world.point_loader`'s call for a ``StatefulDataLoader``, whose
  sampler and dataset it points as any DataLoader's) makes the loader's ``state_dict`` carry the data-parallel size it
  was taken in (:data:`DP_SIZE`) and its ``load_state_dict`` resume in this one:

  - the same data-parallel size (any tp or pp), or a state without the key: torchdata's own resume, exact;
  - another size, a map-style dataset over a ``DistributedSampler`` (Lightning's or the user's, also torchdata's
    ``StatefulDistributedSampler``), no workers: converted through samples. ``DistributedSampler`` deals the epoch's
    order out rank by rank, so ``k`` samples taken by each of ``before`` replicas are the order's first
    ``k * before``; each of the ``now`` replicas skips ``k * before / now`` of its own and the run continues at the
    next sample, none skipped, none repeated (the loader's ``resume_batch`` says at which batch of the epoch:
    :mod:`~lightning_ciuic.data.resume`). Where ``k * before`` is not a whole number of the new global batches
    (``now * batch_size``), refused (:class:`ValueError`), saying what would work;
  - another size, otherwise (an ``IterableDataset``, whose state is its replica's; worker processes, whose snapshot
    counts what the workers were sent; a stateful batch sampler of unknown state): refused, saying what would work.

No Lightning imports.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn

from torch.utils.data import DistributedSampler, IterableDataset

from lightning_ciuic.data.resume import RESUME_BATCH

DP_SIZE = "lightning_ciuic_data_parallel_size"


def is_stateful_loader(loader: Any) -> bool:
    """Whether ``loader`` is torchdata's ``StatefulDataLoader`` (without importing torchdata where it is not)."""
    if "torchdata" not in sys.modules:
        return False
    from torchdata.stateful_dataloader import StatefulDataLoader

    return isinstance(loader, StatefulDataLoader)


def point_stateful(loader: Any, size: int, samplers: list[DistributedSampler]) -> None:
    """Make ``loader`` save its data-parallel ``size`` and resume from another one (see the module docstring);
    ``samplers``: its distributed samplers, already pointed at the data-parallel world."""
    if getattr(loader.load_state_dict, "_data_parallel_world", False):
        return
    save: Callable[[], dict[str, Any]] = loader.state_dict
    load: Callable[[dict[str, Any]], None] = loader.load_state_dict

    def state_dict() -> dict[str, Any]:
        return {**save(), DP_SIZE: size}

    def load_state_dict(state: dict[str, Any]) -> None:
        if isinstance(state, dict) and DP_SIZE in state:
            state = dict(state)
            before = int(state.pop(DP_SIZE))
            if before != size:
                state = converted(state, before, size, loader, samplers)
                if not state.get("_iterator_finished"):
                    setattr(loader, RESUME_BATCH, int(state["_num_yielded"]))
        load(state)

    load_state_dict._data_parallel_world = True  # type: ignore[attr-defined]
    loader.state_dict, loader.load_state_dict = state_dict, load_state_dict


def converted(
    state: dict[str, Any], before: int, now: int, loader: Any, samplers: list[DistributedSampler]
) -> dict[str, Any]:
    """``state``, taken by one of ``before`` replicas, as one of ``now`` replicas continues from it."""
    if state.get("_iterator_finished"):
        return state  # the epoch was over: the next one starts at its first sample on any number of replicas
    name = f"the {type(loader).__name__} over {type(loader.dataset).__name__}"
    works = f"resume on {before} data-parallel replicas (any tensor or pipeline size)"
    if isinstance(loader.dataset, IterableDataset):
        _refuse(name, before, now, "an IterableDataset's state is its own replica's share, which cannot be re-split", works)
    if "_num_yielded" not in state:
        _refuse(
            name, before, now, "with worker processes (num_workers > 0) its state counts the samples sent to the"
            " workers, not those trained", f"{works}, or train with num_workers=0",
        )
    if not samplers or state.get("_index_sampler_state") is not None:
        _refuse(
            name, before, now, "only a DistributedSampler's order (Lightning's, or one of the user's) is known to be"
            " dealt out rank by rank", f"{works}, or sample with a DistributedSampler",
        )
    batch = int(loader.batch_size or 1)
    taken = int(state["_sampler_iter_yielded"]) * batch * before
    stride = batch * now
    if taken % stride:
        _refuse(
            name, before, now, f"{taken} samples of the epoch were taken ({before} x batches of {batch}), not a whole"
            f" number of the {stride} samples of a step on {now} replicas",
            f"{works}, or from a checkpoint taken after a multiple of {stride} samples of the epoch",
        )
    batches = taken // stride
    state = {**state, "_sampler_iter_yielded": batches, "_num_yielded": batches}
    inner = state.get("_sampler_iter_state")
    if isinstance(inner, dict):  # torchdata's BatchSampler's iterator, with its sampler's state where it has one
        inner = {**inner, "samples_yielded": batches * batch}
        if isinstance(inner.get("sampler_state"), dict) and "yielded" in inner["sampler_state"]:
            inner["sampler_state"] = {**inner["sampler_state"], "yielded": batches * batch}
        state["_sampler_iter_state"] = inner
    return state


def _refuse(name: str, before: int, now: int, why: str, works: str) -> NoReturn:
    raise ValueError(
        f"Cannot resume {name} saved over {before} data-parallel replicas on {now} without skipping or repeating"
        f" samples: {why}. What works: {works}."
    )
