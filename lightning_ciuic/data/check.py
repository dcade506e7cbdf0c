"""The equal-batch check: the ranks that must train on the same batch compare a hash of it.

Contract:

* :func:`batch_digest` is a 64-bit hash of a batch's content: every tensor's dtype, shape and bytes, nested lists,
  tuples and mappings (keys in sorted order), numbers and strings; any other object by its type's name only (its
  ``repr`` may hold an address). Equal batches give equal digests on every rank.
* :class:`EqualBatchCheck` is armed by the strategy whenever a training loader is prepared and after every restore
  (a checkpoint, a snapshot, an elastic re-mesh starts the processes and so prepares the loaders again), and runs on
  the next training batch: one ``all_gather`` of ``(data-parallel rank, digest)`` over all ranks, then every rank
  decides alike. Ranks with the same data-parallel rank (tensor-parallel peers, pipeline stages, expert-parallel
  peers among them) that read the data (not a middle pipeline stage, whose batch is a
  :class:`~lightning_ciuic.data.stages.NotRead`: :mod:`.stages`) must hold equal digests; where they do not, every
  rank raises :class:`BatchMismatchError` together, rank 0 with the message (which ranks, which loader, what to
  do), the others quietly
  (:func:`~lightning_ciuic.parallel.shutdown.raise_once`). Data-parallel replicas holding the *same* batch are
  told once, as a warning (each sample trained ``dp`` times: a loader that does not split at all, or a dataset
  whose samples are alike).
* One process, or one rank per replica (no tensor or pipeline parallelism: the global rank is the data-parallel
  rank), compares nothing and runs no collective.

No Lightning imports.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ciuic import compat
from lightning_ciuic.data.stages import NotRead
from lightning_ciuic.data.world import HOOK, LoaderReport
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.shutdown import raise_once


class BatchMismatchError(RuntimeError):
    """Ranks that must train on the same batch got different ones."""


def batch_digest(batch: Any) -> int:
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, batch)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        local = getattr(value, "to_local", None)
        tensor = (local() if callable(local) else value).detach()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"mapping {len(value)};".encode())
        for key in sorted(value, key=str):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)};".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        digest.update(f"{type(value).__name__} {value!r};".encode())
    elif hasattr(value, "tobytes") and hasattr(value, "shape"):  # numpy arrays
        digest.update(f"array {value.dtype} {tuple(value.shape)};".encode())
        digest.update(value.tobytes())
    else:
        digest.update(f"object {type(value).__qualname__};".encode())


class EqualBatchCheck:
    """Armed by the strategy, run on the next training batch (see the module docstring)."""

    def __init__(self) -> None:
        self.armed = False
        self.loader: Optional[LoaderReport] = None
        self.runs = 0  # comparisons made (a test's evidence that the check ran)
        self._warned = False

    def arm(self, loader: Optional[LoaderReport] = None) -> None:
        self.armed = True
        if loader is not None:
            self.loader = loader

    def run(self, batch: Any, dims: Optional[ParallelDims], device: torch.device, when: str = "first step") -> None:
        self.armed = False
        if dims is None or not dist.is_initialized() or dims.world_size == 1:
            return
        if dims.pp * dims.tp == 1:
            return  # one rank per replica: nothing must be equal (and the global rank is the data-parallel one)
        rank, world = dist.get_rank(), dist.get_world_size()
        reads = not isinstance(batch, NotRead)  # a middle pipeline stage reads no data: it is left out
        row = [dims.dp_rank_of(rank), batch_digest(batch)] if reads else [-1, 0]
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = torch.empty(world * 2, dtype=torch.int64, device=device)
        compat.all_gather_single(rows, mine)
        self.runs += 1
        pairs = [tuple(pair) for pair in rows.view(world, 2).tolist()]
        replicas: dict[int, dict[int, list[int]]] = {}
        for global_rank, (dp_rank, digest) in enumerate(pairs):
            if dp_rank < 0:
                continue
            replicas.setdefault(dp_rank, {}).setdefault(digest, []).append(global_rank)
        differing = {dp_rank: held for dp_rank, held in replicas.items() if len(held) > 1}
        if differing:
            raise_once(BatchMismatchError(self._message(differing, dims, when)))
        self._tell_duplicates(replicas, dims, rank)

    def _message(self, differing: dict[int, dict[int, list[int]]], dims: ParallelDims, when: str) -> str:
        peers = "tensor-parallel peers" if dims.pp == 1 else "tensor-parallel peers and pipeline stages" if dims.tp > 1 else "pipeline stages"
        cases = []
        for dp_rank, held in sorted(differing.items())[:4]:
            groups = " / ".join(", ".join(_coordinates(r, dims) for r in ranks) for ranks in held.values())
            cases.append(f"replica {dp_rank}: {len(held)} different batches ({groups})")
        more = f" (and {len(differing) - 4} more replicas)" if len(differing) > 4 else ""
        loader = self.loader or LoaderReport("the training loader", "map")
        done = f" The strategy did this to it: {'; '.join(loader.notes)}." if loader.notes else ""
        return (
            f"HybridParallelStrategy ({dims}): the {peers} of a data-parallel replica must train on the same batch, but"
            f" at the {when} they hold different ones: {'; '.join(cases)}{more}. The loader: {loader.description}."
            f"{done} {_advice(loader.kind, dims)}"
        )

    def _tell_duplicates(self, replicas: dict[int, dict[int, list[int]]], dims: ParallelDims, rank: int) -> None:
        if self._warned or dims.dp == 1:
            return
        owners: dict[int, list[int]] = {}
        for dp_rank, held in replicas.items():
            owners.setdefault(next(iter(held)), []).append(dp_rank)
        same = [replicas_ for replicas_ in owners.values() if len(replicas_) > 1]
        self._warned = True
        if same and rank == 0:
            warnings.warn(
                f"HybridParallelStrategy ({dims}): data-parallel replicas {same[0]} train on the same batch. If the"
                " loader does not split its data (a dataset built before the processes started, or one that ignores"
                " the rank), every sample is trained on by each replica; split by the data-parallel rank"
                " (lightning_ciuic.data_parallel_world()). Alike samples in the data cause this too.",
                stacklevel=2,
            )


def _coordinates(rank: int, dims: ParallelDims) -> str:
    parts = [f"pp {rank // (dims.dp * dims.tp)}"] if dims.pp > 1 else []
    parts += [f"tp {rank % dims.tp}"] if dims.tp > 1 else []
    return f"rank {rank} ({', '.join(parts)})" if parts else f"rank {rank}"


def _advice(kind: str, dims: ParallelDims) -> str:
    replicas = f"{dims.dp} replica{'s' if dims.dp > 1 else ''}"
    split = f"by the data-parallel rank and size ({replicas}), not by torch.distributed's global rank"
    if kind == "iterable":
        return (
            f"An IterableDataset splits its data itself, and this one does not split {split} (torch.distributed."
            f"get_rank() / get_world_size() are the global ones). Give it a method {HOOK}(rank, size), which the"
            f" strategy calls with this rank's data-parallel rank and size before the first batch, or read"
            f" lightning_ciuic.data_parallel_world() in __iter__; and seed any shuffling alike on every rank."
        )
    if kind == "hook":
        return (
            f"Its {HOOK}(rank, size) was called with the data-parallel rank and size: split by those alone, and seed"
            " any shuffling, sampling or augmentation alike on every rank of a replica (not by the global rank)."
        )
    if kind == "litdata":
        return (
            "The strategy made LitData split over the data-parallel replicas: seed its shuffling alike on every rank"
            " (StreamingDataset(seed=...)) and build the dataset the same way on every rank."
        )
    if kind == "sampler":
        return (
            f"Its distributed sampler must split {split}: build it with trainer.strategy.distributed_sampler_kwargs"
            " (num_replicas, rank), or leave the sampler to Lightning (use_distributed_sampler=True), with the same"
            " seed on every rank; randomness in collate_fn or the dataset must be seeded alike too."
        )
    return (
        "Make every rank of a replica produce the same batch: the same order (a sampler seeded alike, or Lightning's"
        " distributed sampler: use_distributed_sampler=True) and no per-rank randomness in the dataset or collate_fn."
    )
