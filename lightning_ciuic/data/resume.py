"""A training DataLoader that knows its position in the epoch and resumes there.

Contract:

* :class:`ResumableBatchSampler` yields the batches of the batch sampler it wraps; after
  ``resume(epoch, batches_done)``, the next pass over epoch ``epoch`` starts after its first ``batches_done``
  batches (once). Its ``sampler`` is the wrapped one's, so ``set_epoch`` reaches a ``DistributedSampler``.
* :class:`PositionedDataLoader` is a DataLoader over a batch sampler with ``resume`` (the one above, or
  :class:`~lightning_ciuic.data.balance.BalancedBatchSampler`). Its ``state_dict`` is the position its owner
  reports through ``position`` (epoch, batches done); ``load_state_dict`` resumes there. Lightning treats such
  a loader as stateful: every checkpoint's loop state carries the position and a resume (``ckpt_path`` or a
  snapshot) continues the epoch with the next unseen batch instead of starting it over. The position is kept with
  the batch's size over all data-parallel ranks, so a resume into another data-parallel size (elastic nodes)
  continues at the same sample of the epoch's order: nothing skipped, nothing repeated (``DistributedSampler``
  deals the order out rank by rank, so the first ``n`` batches of all ranks are its first ``n * window`` samples).
* :func:`positioned` builds one from any DataLoader with the same settings (workers, collate, ...); ``source``
  keeps the loader it was built from. :func:`with_batch_sampler` is that rebuild for any batch sampler.
* ``resume_batch``: a loader whose ``load_state_dict`` moved it to another batch index than the saved one (a state
  from another data-parallel size: this one's, LitData's through :mod:`~lightning_ciuic.data.world`, torchdata's
  through :mod:`~lightning_ciuic.data.stateful`) sets this attribute to the batch of the running epoch its next batch
  is. The strategy moves the epoch loop's batch counters there before the first batch (:func:`take_resume_batch`),
  or the loop would end the epoch where the saved size's batch count says: early on more replicas (the loader's
  remaining batches then skipped, or, LitData, replayed from the restored state in the next epoch), late on fewer.
* :func:`keep_position` is what the strategy does with every training loader: a plain map-style DataLoader becomes
  a positioned one reporting ``position``, whatever saves the checkpoint (``ModelCheckpoint``,
  ``AsyncCheckpointer``, a snapshot); a loader that keeps its own state (a ``state_dict`` of its class: LitData's,
  torchdata's) or has no batch sampler (an iterable dataset) is returned as it is.

No Lightning imports.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional, TypeVar

from torch.utils.data import DataLoader, IterableDataset, Sampler

_Loader = TypeVar("_Loader", bound=DataLoader)
RESUME_BATCH = "resume_batch"


class ResumableBatchSampler(Sampler[list[int]]):
    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self._resume: Optional[tuple[int, int]] = None

    def resume(self, epoch: int, batches_done: int) -> None:
        self._resume = (epoch, batches_done)

    @property
    def window(self) -> int:
        """Samples one batch index covers over all data-parallel ranks."""
        return getattr(self.batch_sampler, "batch_size", 1) * getattr(self.sampler, "num_replicas", 1)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._resume = self._resume, None
        epoch = getattr(self.sampler, "epoch", None)
        first = skip[1] if skip is not None and (epoch is None or epoch == skip[0]) else 0
        for index, batch in enumerate(self.batch_sampler):
            if index >= first:
                yield batch


class PositionedDataLoader(DataLoader):
    """A DataLoader whose position Lightning saves in checkpoints and restores; see the module docstring."""

    source: Optional[DataLoader] = None
    position: Optional[Callable[[], tuple[int, int]]] = None
    resume_batch: Optional[int] = None  # see the module docstring

    def state_dict(self) -> dict[str, int]:
        if self.position is None:
            return {}
        epoch, batches_done = self.position()
        return {"epoch": int(epoch), "batches_done": int(batches_done), "window": self.batch_sampler.window}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume at the saved position. Saved with another data-parallel size (``window``: samples per batch
        index over all ranks), the position is converted through samples: the next batch starts at the first
        sample of the epoch's order not yet seen."""
        if not state_dict:
            return
        done, window = state_dict["batches_done"], state_dict.get("window", self.batch_sampler.window)
        samples, now = done * window, self.batch_sampler.window
        if samples % now:
            warnings.warn(
                f"resuming at sample {samples} of the epoch, which is not a multiple of {now} samples per batch over"
                f" the data-parallel ranks: the first {samples % now} samples of the next batch are seen again."
            )
        if now != window:
            self.resume_batch = samples // now
        self.batch_sampler.resume(state_dict["epoch"], samples // now)


def take_resume_batch(loader: Any) -> Optional[int]:
    """``loader``'s ``resume_batch`` (see the module docstring), once: it is cleared; ``None`` where none was set."""
    batch = getattr(loader, RESUME_BATCH, None)
    if batch is not None:
        setattr(loader, RESUME_BATCH, None)
    return batch


def positioned(loader: DataLoader) -> PositionedDataLoader:
    if isinstance(loader, PositionedDataLoader):
        return loader
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        raise TypeError("a DataLoader without a batch sampler (batch_size=None) has no batch position to resume.")
    if not callable(getattr(batch_sampler, "resume", None)):
        batch_sampler = ResumableBatchSampler(batch_sampler)
    rebuilt = with_batch_sampler(loader, batch_sampler, PositionedDataLoader)
    rebuilt.source = loader
    return rebuilt


def keep_position(loader: Any, position: Callable[[], tuple[int, int]]) -> Any:
    """``loader`` resumable at its batch (see the module docstring), its position read from ``position``."""
    own_state = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    if isinstance(getattr(loader, "dataset", None), IterableDataset):  # no batch sampler to position
        if not own_state:
            warnings.warn(
                f"the training loader's {type(loader.dataset).__name__} (an IterableDataset) has no state_dict; a resume"
                " restarts its epoch. LitData's StreamingDataLoader or torchdata's StatefulDataLoader keep their position."
            )
        return loader
    own_state = own_state and type(loader) is not DataLoader
    if not isinstance(loader, DataLoader) or loader.batch_sampler is None or (own_state and not isinstance(loader, PositionedDataLoader)):
        return loader
    loader = positioned(loader)
    loader.position = position
    return loader


def with_batch_sampler(loader: DataLoader, batch_sampler: Any, cls: type[_Loader] = DataLoader) -> _Loader:
    """A ``cls`` with ``loader``'s settings (workers, collate, pinning, ...) over ``batch_sampler``."""
    return cls(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
