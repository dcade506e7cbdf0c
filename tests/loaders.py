"""Loaders of every kind for the data tests (tests/integration/test_data_loaders.py): sample ``i`` is the token
window ``i, i+1, ...`` (mod 256), so a batch's first column names its samples, whichever loader produced it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_ciuic import data_parallel_world
from lightning_ciuic.data.stages import NotRead
from tests.helpers import SEQ_LEN

N, BATCH = 32, 2


def window(i: int) -> torch.Tensor:
    return (torch.arange(SEQ_LEN + 1) + i) % 256


def write_litdata(path: Path, n: int = N) -> None:
    """A LitData dataset of ``n`` windows in small chunks (several per replica)."""
    from litdata import optimize

    optimize(fn=window, inputs=list(range(n)), output_dir=str(path), chunk_bytes="1KB", num_workers=1, mode="overwrite")


class Numbered(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        t = window(i)
        return t[:-1], t[1:]


class ByGlobalRank(IterableDataset):
    """Splits itself by torch.distributed's rank and world size, by hand (what most hand-written streams do)."""

    def world(self) -> tuple[int, int]:
        return dist.get_rank(), dist.get_world_size()

    def __iter__(self):
        rank, size = self.world()
        for i in range(rank, N - N % size, size):
            t = window(i)
            yield t[:-1], t[1:]


class WithHook(ByGlobalRank):
    """Splits by what the strategy's ``set_data_parallel(rank, size)`` said."""

    given: tuple[int, int] | None = None

    def set_data_parallel(self, rank: int, size: int) -> None:
        self.given = (rank, size)

    def world(self) -> tuple[int, int]:
        assert self.given is not None, "set_data_parallel was not called"
        return self.given


class ByDataParallelWorld(ByGlobalRank):
    """Reads lightning_ciuic.data_parallel_world() in __iter__."""

    def world(self) -> tuple[int, int]:
        world = data_parallel_world()
        return world.rank, world.size


def _record(out: str, sample: int) -> None:
    """Append ``sample`` to ``<out>/reads-rank<r>.txt`` (r: this process's global rank): what its dataset read."""
    with open(Path(out) / f"reads-rank{dist.get_rank()}.txt", "a") as file:
        file.write(f"{sample}\n")


def reads_by_rank(out, world_size: int) -> list[list[int]]:
    """The samples each rank's dataset read (``[]``: none), in order."""
    paths = [Path(out) / f"reads-rank{r}.txt" for r in range(world_size)]
    return [[int(line) for line in path.read_text().split()] if path.exists() else [] for path in paths]


class RecordedStream(ByDataParallelWorld):
    """An unsized stream (reads lightning_ciuic.data_parallel_world()) recording each sample it yields."""

    def __init__(self, out: str) -> None:
        self.out = out

    def __iter__(self):
        for inputs, targets in super().__iter__():
            _record(self.out, int(inputs[0]))
            yield inputs, targets


class RecordedNumbered(Numbered):
    """A map-style dataset recording each ``__getitem__``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def __getitem__(self, i: int):
        _record(self.out, i)
        return super().__getitem__(i)


def _litdata_windows():
    from litdata import StreamingDataset

    class Windows(StreamingDataset):
        def __getitem__(self, index):
            t = super().__getitem__(index)
            return t[:-1], t[1:]

    return Windows


class Loaders(LightningDataModule):
    """``kind``: ``"litdata"``, ``"stateful"`` (torchdata's StatefulDataLoader, Lightning's sampler),
    ``"stateful-sampler"`` (the same over torchdata's StatefulDistributedSampler, shuffling, built by the user), ``"sampler"`` (a DistributedSampler the user builds over the global world),
    ``"global"``, ``"hook"``, ``"world"`` (the iterable datasets above), ``"recorded-map"``, ``"recorded-stream"``
    (recording what each rank read into ``out``). Built in each rank, after the processes
    started, as a real job builds them."""

    def __init__(self, kind: str, litdata_dir: str = "", out: str = "") -> None:
        super().__init__()
        self.kind, self.litdata_dir, self.out = kind, litdata_dir, out

    def train_dataloader(self):
        if self.kind == "litdata":
            from litdata import StreamingDataLoader

            return StreamingDataLoader(_litdata_windows()(self.litdata_dir), batch_size=BATCH)
        if self.kind == "stateful":  # torchdata's; Lightning injects its DistributedSampler
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(Numbered(), batch_size=BATCH)
        if self.kind == "stateful-sampler":  # torchdata's, with its shuffling sampler built over the global world
            from torchdata.stateful_dataloader import StatefulDataLoader
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            dataset = Numbered()
            return StatefulDataLoader(dataset, batch_size=BATCH, sampler=StatefulDistributedSampler(dataset, seed=3))
        if self.kind == "sampler":
            dataset = Numbered()
            return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))
        if self.kind == "recorded-map":  # Lightning's sampler
            return DataLoader(RecordedNumbered(self.out), batch_size=BATCH)
        if self.kind == "recorded-stream":
            return DataLoader(RecordedStream(self.out), batch_size=BATCH)
        datasets = {"global": ByGlobalRank, "hook": WithHook, "world": ByDataParallelWorld}
        return DataLoader(datasets[self.kind](), batch_size=BATCH)


class SeenSamples(Callback):
    """Each rank appends ``[epoch, batch_idx, samples]`` of every training batch to ``out/rank<r>.json``."""

    def __init__(self, out) -> None:
        self.out, self.seen = str(out), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        samples = None if isinstance(batch, NotRead) else batch[0][:, 0].tolist()  # None: a middle pipeline stage
        self.seen.append([trainer.current_epoch, batch_idx, samples])

    def on_train_end(self, trainer, pl_module):
        path = Path(self.out) / f"rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + self.seen))


def seen_by_rank(out, world_size: int) -> list[list]:
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
