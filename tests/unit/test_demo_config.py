"""The shipped main-job configs and the demo's run in miniature: one epoch is the run (``limit_train_batches`` =
``max_steps``), so the progress bar counts the steps the run takes, not the corpus's whole epoch; the demo's saves
are step saves, named by the epoch the bar shows; and the README's resume of a finished run, both limits raised,
trains one more epoch (raising ``max_steps`` alone trains nothing: the one epoch allowed is done)."""

import shutil
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import TQDMProgressBar

from examples.data import ByteCorpusDataModule
from examples.deepseek import DeepSeekMini
from lightning_ciuic import AsyncCheckpointer, WarmupCosineSchedule
from tests.helpers import TINY_MODEL, loader

EVERY = 4
CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.mark.parametrize("name", ["demo.yaml", "pipeline.yaml", "sharded.yaml", "experts.yaml"])
def test_one_epoch_of_the_shipped_main_jobs_is_the_run(name):
    config = yaml.safe_load((CONFIGS / name).read_text())
    trainer = config["trainer"]
    assert trainer["limit_train_batches"] == trainer["max_steps"] and trainer["max_epochs"] == 1
    assert trainer.get("accumulate_grad_batches", 1) == 1  # one batch, one optimizer step
    data = ByteCorpusDataModule(**config["data"]["init_args"])
    data.setup("fit")
    dp = config["trainer"]["strategy"]["init_args"].get("data_parallel_size", 1)
    # each replica's epoch is longer than the run: the limit, not the corpus, sets what the bar counts
    assert len(data.train_set) // dp // data.batch_size >= trainer["max_steps"]


def test_the_demos_last_save_is_its_last_steps():
    trainer = yaml.safe_load((CONFIGS / "demo.yaml").read_text())["trainer"]
    (saver,) = [c["init_args"] for c in trainer["callbacks"] if c["class_path"].endswith("AsyncCheckpointer")]
    assert trainer["max_steps"] % saver["every_n_train_steps"] == 0 and not saver.get("save_interval")


class _Bar(TQDMProgressBar):
    """Records the total the training bar counts to at each epoch's start, and each batch's (epoch, index)."""

    def __init__(self):
        super().__init__()
        self.totals, self.batches = [], []

    def on_train_epoch_start(self, trainer, pl_module):
        super().on_train_epoch_start(trainer, pl_module)
        self.totals.append((trainer.current_epoch, self.train_progress_bar.total))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.batches.append((trainer.current_epoch, batch_idx))


def _fit(url, max_steps, max_epochs, ckpt_path=None):
    """The demo's trainer settings scaled down: one epoch of 4 batches (of the loader's 20) = max_steps, a save every
    EVERY steps."""
    seed_everything(7)
    bar = _Bar()
    saver = AsyncCheckpointer(url, every_n_train_steps=EVERY, save_interval=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=max_epochs, limit_train_batches=4,
                      limit_val_batches=0, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[bar, saver, WarmupCosineSchedule(warmup_ratio=0.25)])
    trainer.fit(DeepSeekMini(**TINY_MODEL), loader(40, 2), ckpt_path=ckpt_path)
    return trainer, bar, [m.name for m in saver.io.catalog.manifests()]


def test_the_demo_in_miniature_counts_its_steps_names_saves_by_the_bars_epoch_and_resumes(tmp_path):
    url = str(tmp_path / "checkpoints")
    trainer, bar, names = _fit(url, max_steps=4, max_epochs=1)  # the demo: 200 steps, one epoch of 200
    assert trainer.global_step == 4 and bar.totals == [(0, 4)]  # "Epoch 0/0 ... 4/4", not 4 of the epoch's 20 batches
    assert names == ["epoch=0-step=4"]  # the last step's save, named by the epoch the bar showed

    trap = str(tmp_path / "trap")  # a copy: a resume with nothing to do still saves at its end, which would shift epochs
    shutil.copytree(url, trap)
    again, _, _ = _fit(trap, max_steps=8, max_epochs=1, ckpt_path="last")  # only max_steps raised: nothing to do
    assert again.global_step == 4

    resumed, bar, names = _fit(url, max_steps=8, max_epochs=2, ckpt_path="last")  # the README's resume
    assert resumed.global_step == 8 and bar.batches == [(1, 0), (1, 1), (1, 2), (1, 3)]  # all of epoch 1
    assert names == ["epoch=0-step=4", "epoch=1-step=8"]
