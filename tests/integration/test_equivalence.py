"""Numerical equivalence: parallel layouts train to the same parameters as single-process training."""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from tests.helpers import TINY_MODEL, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH = 4, 2


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**TINY_MODEL)


def _fit(module: LightningModule, strategy, devices: int, dp: int, **trainer_kwargs) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * dp, PER_RANK_BATCH))
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "dp, tp, clip",
    [(2, 1, None), (1, 2, 0.05), (2, 2, 0.05)],
    ids=["dp2", "tp2-clip", "dp2xtp2-clip"],
)
def test_layout_matches_single_process(dp, tp, clip):
    strategy = HybridParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, start_method="spawn")
    actual = _fit(_tiny(), strategy, dp * tp, dp, gradient_clip_val=clip)
    expected = reference_training(_tiny, STEPS, PER_RANK_BATCH * dp, clip=clip)
    assert_state_close(actual, expected)


class PlainRegression(LightningModule):
    """A module written for DDPStrategy: no configure_model, nothing parallel-specific."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 8, 256))

    def _loss(self, batch):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self.net(inputs), targets[:, -1])

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _plain() -> PlainRegression:
    seed_everything(3)
    return PlainRegression()


def test_ddp_module_trains_unchanged_under_ciuic():
    expected = reference_training(_plain, STEPS, PER_RANK_BATCH * 2)
    ours = _fit(_plain(), "ciuic_spawn", 2, 2)
    ddp = _fit(_plain(), "ddp_spawn", 2, 2)
    assert_state_close(ours, expected)
    assert_state_close(ours, ddp)
