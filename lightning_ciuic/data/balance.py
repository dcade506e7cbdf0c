"""Uneven shares of one global batch across data-parallel ranks, with exact epoch coverage.

Contract:

* :class:`BalancedBatchSampler` walks an epoch in *global* batches of ``global_batch_size`` samples: global
  batch ``i`` is the window ``order[i * B : (i + 1) * B]`` of the epoch's order, where ``order`` is
  ``torch.randperm(n)`` seeded with ``seed + epoch`` (the permutation ``DistributedSampler`` uses), or
  ``range(n)`` without shuffling. Rank ``r`` receives the contiguous slice of that window given by the
  current ``split`` (samples per rank, summing to ``B``). So, whatever the split, each global batch is the
  same set of samples as under ``DistributedSampler`` with an even split, every sample of the epoch is seen
  exactly once across ranks, and changing the split between batches keeps that true as long as every rank
  applies the same split to the same batch (the callback changes it at the same step on every rank).
* The last window of an epoch may be short (``drop_last=False``): it is split in the same proportions,
  at least one sample per rank; if fewer samples than ranks remain they are dropped (like ``drop_last``).
* :meth:`BalancedBatchSampler.resume` skips the global batches already trained in an epoch, for exact
  mid-epoch resume.
* :func:`proportional_split` turns per-rank speeds into integer shares (largest remainder, floor
  ``min_samples``); :func:`imbalance` is ``(slowest - fastest) / mean`` of per-rank step times.

No Lightning imports: the callback in ``lightning_ciuic.callbacks.data_balance`` drives this.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch.utils.data import Sampler


def proportional_split(total: int, weights: Sequence[float], min_samples: int = 1) -> list[int]:
    """Integer shares of ``total`` proportional to ``weights`` (largest-remainder rounding), each at least
    ``min_samples``; the shares always sum to ``total``."""
    n = len(weights)
    if n < 1 or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}.")
    if min_samples < 1 or min_samples * n > total:
        raise ValueError(
            f"cannot give each of {n} ranks at least {min_samples} of {total} samples; use a global batch of at"
            f" least {max(1, min_samples) * n} or a smaller minimum share."
        )
    floored: set[int] = set()  # ranks held at min_samples; the rest share what is left by weight
    while True:
        free = total - min_samples * len(floored)
        weight = sum(w for r, w in enumerate(weights) if r not in floored)
        ideal = [min_samples if r in floored else free * w / weight for r, w in enumerate(weights)]
        below = {r for r in range(n) if r not in floored and ideal[r] < min_samples}
        if not below:
            break
        floored |= below
    shares = [int(math.floor(x)) for x in ideal]
    by_remainder = sorted(range(n), key=lambda r: (ideal[r] - shares[r], -r), reverse=True)
    for r in by_remainder[: total - sum(shares)]:
        shares[r] += 1
    return shares


def imbalance(step_times: Sequence[float]) -> float:
    """``(slowest - fastest) / mean`` of per-rank step times (0 when all are equal)."""
    mean = sum(step_times) / len(step_times)
    return 0.0 if mean <= 0 else (max(step_times) - min(step_times)) / mean


class EpochOrder(Sampler[int]):
    """Every index of the dataset once per epoch: ``randperm(n)`` seeded with ``seed + epoch`` (the order
    ``DistributedSampler`` draws before splitting it), or ``range(n)`` without shuffling. Lightning calls
    ``set_epoch`` on it as the ``sampler`` of the batch sampler."""

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples, self.shuffle, self.seed, self.epoch = num_samples, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch; see the module docstring for the guarantees."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int,
        num_replicas: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        split: Optional[Sequence[int]] = None,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is outside 0..{num_replicas - 1}.")
        if global_batch_size < num_replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size} cannot give each of {num_replicas} ranks a sample."
            )
        self.sampler = EpochOrder(num_samples, shuffle, seed)
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.rank, self.num_replicas, self.drop_last = rank, num_replicas, drop_last
        self._resume: Optional[tuple[int, int]] = None
        self.split = list(split) if split is not None else even_split(global_batch_size, num_replicas)

    @property
    def split(self) -> list[int]:
        return list(self._split)

    @split.setter
    def split(self, split: Sequence[int]) -> None:
        split = [int(s) for s in split]
        if len(split) != self.num_replicas or sum(split) != self.global_batch_size or min(split) < 1:
            raise ValueError(
                f"split={split} must give each of {self.num_replicas} ranks at least one sample and sum to the"
                f" global batch size {self.global_batch_size}."
            )
        self._split = split

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def window(self) -> int:
        """Samples one batch index covers over all ranks (see :mod:`lightning_ciuic.data.resume`)."""
        return self.global_batch_size

    def resume(self, epoch: int, batches_done: int) -> None:
        """In epoch ``epoch``, start after the first ``batches_done`` global batches (once)."""
        self._resume = (epoch, batches_done)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order, batch = list(self.sampler), self.global_batch_size
        first = 0
        if self._resume is not None and self._resume[0] == self.sampler.epoch:
            first = self._resume[1]
        self._resume = None
        for i in range(first, len(self)):
            window = order[i * batch : (i + 1) * batch]
            if len(window) < self.num_replicas:
                return  # fewer samples left than ranks: dropped, as documented
            counts = self.split if len(window) == batch else proportional_split(len(window), self.split)
            start = sum(counts[: self.rank])
            yield window[start : start + counts[self.rank]]


def even_split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def rebalanced_split(
    split: Sequence[int],
    speeds: Sequence[float],
    step_times: Sequence[float],
    threshold: float,
    min_samples: int = 1,
    max_shift: Optional[float] = None,
) -> Optional[list[int]]:
    """The next split, or ``None`` to keep ``split``.

    Nothing changes while ``imbalance(step_times) <= threshold``. Otherwise the target gives each rank a share
    proportional to its ``speeds`` (samples per second). With ``max_shift`` the move from ``split`` towards the
    target is scaled down (the same fraction for every rank) so that no rank's share changes by more than
    ``max_shift`` of its current value in one rebalance."""
    if imbalance(step_times) <= threshold:
        return None
    total = sum(split)
    target = proportional_split(total, speeds, min_samples)
    fraction = 1.0
    if max_shift is not None:
        for current, wanted in zip(split, target):
            if wanted != current:
                fraction = min(fraction, max_shift * current / abs(wanted - current))
    moved = [current + fraction * (wanted - current) for current, wanted in zip(split, target)]
    new = proportional_split(total, moved, min_samples)
    return None if new == list(split) else new
