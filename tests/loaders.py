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


def _litdata_windows():
    from litdata import StreamingDataset

    class Windows(StreamingDataset):
        def __getitem__(self, index):
            t = super().__getitem__(index)
            return t[:-1], t[1:]

    return Windows


class Loaders(LightningDataModule):
    """``kind``: ``"litdata"``, ``"sampler"`` (a DistributedSampler the user builds over the global world),
    ``"global"``, ``"hook"``, ``"world"`` (the iterable datasets above). Built in each rank, after the processes
    started, as a real job builds them."""

    def __init__(self, kind: str, litdata_dir: str = "") -> None:
        super().__init__()
        self.kind, self.litdata_dir = kind, litdata_dir

    def train_dataloader(self):
        if self.kind == "litdata":
            from litdata import StreamingDataLoader

            return StreamingDataLoader(_litdata_windows()(self.litdata_dir), batch_size=BATCH)
        if self.kind == "sampler":
            dataset = Numbered()
            return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))
        datasets = {"global": ByGlobalRank, "hook": WithHook, "world": ByDataParallelWorld}
        return DataLoader(datasets[self.kind](), batch_size=BATCH)


class SeenSamples(Callback):
    """Each rank appends ``[epoch, batch_idx, samples]`` of every training batch to ``out/rank<r>.json``."""

    def __init__(self, out) -> None:
        self.out, self.seen = str(out), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append([trainer.current_epoch, batch_idx, batch[0][:, 0].tolist()])

    def on_train_end(self, trainer, pl_module):
        path = Path(self.out) / f"rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + self.seen))


def seen_by_rank(out, world_size: int) -> list[list]:
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]
