"""Byte-level language-modelling data from the shipped public-domain corpus.

``ByteCorpusDataModule(path, seq_len, batch_size)`` cuts the file's bytes into non-overlapping windows of
``seq_len + 1`` bytes (inputs are the first ``seq_len``, targets the last ``seq_len``); the last
``val_fraction`` of the windows is held out for validation. Nothing is downloaded: the default corpus is
``examples/data/kjv_pentateuch.txt`` (Genesis to Deuteronomy, King James Version, public domain).
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

DEFAULT_CORPUS = Path(__file__).parent / "data" / "kjv_pentateuch.txt"


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // (self.seq_len + 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * (self.seq_len + 1)
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class ByteCorpusDataModule(LightningDataModule):
    def __init__(
        self,
        path: str = str(DEFAULT_CORPUS),
        seq_len: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        self.path, self.seq_len, self.batch_size = Path(path), seq_len, batch_size
        self.val_fraction, self.shuffle, self.num_workers = val_fraction, shuffle, num_workers

    def setup(self, stage: str | None = None) -> None:
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus {self.path} not found; pass data.path=<a text file>.")
        data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8)
        windows = ByteWindows(data, self.seq_len)
        n_val = int(len(windows) * self.val_fraction)
        split = (len(windows) - n_val) * (self.seq_len + 1)
        self.train_set = ByteWindows(data[: split + 1], self.seq_len)
        self.val_set = ByteWindows(data[split:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
