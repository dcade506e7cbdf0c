"""DynamicDataBalancer through Lightning: a straggler gets a smaller share, training stays exact.

Equivalence: two ranks, rank 1 slowed by an injected delay, the split moves (checked), and the parameters
still equal single-process training on the same global batches. Coverage: over epochs and a mid-epoch resume,
every sample of each epoch is trained exactly once across ranks, and the split is restored from the checkpoint.
"""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from examples.deepseek import DeepSeekMini
from lightning_ciuic import DynamicDataBalancer, HybridParallelStrategy
from lightning_ciuic.testing import SlowRank
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader, reference_training

pytestmark = pytest.mark.serial  # the balancer acts on measured step times: `make test` runs these alone

STEPS, PER_RANK_BATCH = 8, 4


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**TINY_MODEL).double()


@pytest.mark.parametrize("strategy", ["ciuic_forkserver", "ddp_spawn"])
@pytest.mark.parametrize("rebalance_strategy", ["throughput", "gradient_aware"])
def test_rebalanced_training_equals_single_process(strategy, rebalance_strategy):
    balancer = DynamicDataBalancer(monitoring_freq=2, rebalance_strategy=rebalance_strategy)
    module = _tiny()
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        callbacks=[balancer, SlowRank(ranks=[1], seconds_per_sample=0.02)],
    )
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    share_fast = float(trainer.callback_metrics["balance/share_0"])
    assert share_fast > PER_RANK_BATCH  # the fast rank took more of the global batch
    assert float(trainer.callback_metrics["balance/imbalance"]) > 0.15
    expected = reference_training(_tiny, STEPS, PER_RANK_BATCH * 2)
    assert_state_close({k: v.detach() for k, v in module.state_dict().items()}, expected, STEPS)


def test_rebalancing_on_the_dp_axis_of_a_dp_x_tp_mesh():
    """dp=2 x tp=2: both tensor-parallel ranks of replica 1 are slow; the replica's share shrinks, exactly."""
    module = _tiny()
    trainer = Trainer(
        strategy=HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="forkserver"),
        accelerator="cpu", devices=4, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.05, precision=PRECISION,
        callbacks=[DynamicDataBalancer(monitoring_freq=2, rebalance_strategy="throughput"), SlowRank([2, 3], 0.02)],
    )
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    assert float(trainer.callback_metrics["balance/share_0"]) > PER_RANK_BATCH
    expected = reference_training(_tiny, STEPS, PER_RANK_BATCH * 2, clip=0.05)
    assert_state_close({k: v.detach() for k, v in module.state_dict().items()}, expected, STEPS)


def test_below_the_threshold_the_split_stays_even():
    trainer = Trainer(
        strategy="ciuic_forkserver", accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DynamicDataBalancer(monitoring_freq=2, imbalance_threshold=100.0), SlowRank([1], 0.02)],
    )
    trainer.fit(_tiny(), loader(4 * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    assert float(trainer.callback_metrics["balance/imbalance"]) > 0.15  # measured, but under the threshold
    assert float(trainer.callback_metrics["balance/share_0"]) == PER_RANK_BATCH


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i


class Recorder(LightningModule):
    """Writes (epoch, batch_idx, sample indices) of every training batch of its rank to ``out/rank<r>.json``."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out, self.seen = out, []
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, index = batch
        self.seen.append((self.current_epoch, batch_idx, index.tolist()))
        return self.layer(x).pow(2).mean()

    def on_train_end(self):
        path = Path(self.out) / f"rank{self.global_rank}.json"
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + self.seen))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("strategy", ["ciuic_forkserver", "ddp_spawn"])
def test_every_sample_once_per_epoch_across_a_mid_epoch_resume(tmp_path, strategy):
    n, batch = 48, 4  # 6 global batches of 8 per epoch

    def fit(max_steps, ckpt_path=None):
        seed_everything(1)
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
            callbacks=[
                DynamicDataBalancer(monitoring_freq=2, rebalance_strategy="throughput"),
                SlowRank(ranks=[1], seconds_per_sample=0.01),
                ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=9, save_top_k=-1),
            ],
        )
        trainer.fit(Recorder(str(tmp_path)), DataLoader(Indexed(n), batch_size=batch), ckpt_path=ckpt_path)

    fit(9)  # epoch 0 and half of epoch 1; checkpoint at step 9
    (checkpoint,) = (tmp_path / "ckpt").iterdir()
    fit(18, ckpt_path=str(checkpoint))  # the rest of epoch 1 and epoch 2

    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(3):
        seen = [i for rank in records for e, _, indices in rank if e == epoch for i in indices]
        assert Counter(seen) == Counter(range(n)), f"epoch {epoch}"
    sizes = {(e, b): len(indices) for e, b, indices in records[0]}
    assert sizes[(0, 0)] == batch and sizes[(1, 2)] > batch  # rebalanced towards the fast rank 0 ...
    assert sizes[(1, 3)] == sizes[(1, 2)]  # ... and the first batch after the resume keeps that split
