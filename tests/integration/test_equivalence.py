"""Numerical equivalence: parallel layouts train to the same parameters as single-process training (float64)."""

import json

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH = 4, 2


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**TINY_MODEL).double()


class UsersOwnLoss(DeepSeekMini):
    """A module written for one process: its step takes the cross-entropy of ``self(inputs)`` and logs it. Under tp
    with sequence parallelism the logits are vocabulary-sharded: the strategy computes that loss from the shards."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train/loss", loss)
        return {"loss": loss}


def _users_own_loss() -> UsersOwnLoss:
    seed_everything(7)
    return UsersOwnLoss(**TINY_MODEL).double()


def _fit(module: LightningModule, strategy, devices: int, dp: int, **trainer_kwargs) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        **trainer_kwargs,
    )
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * dp, PER_RANK_BATCH))
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "dp, tp, clip, kernels, factory",
    [
        (2, 1, None, None, _tiny), (1, 2, 0.05, None, _users_own_loss), (2, 2, 0.05, None, _tiny),
        (2, 2, 0.05, "default", _tiny),
    ],
    ids=["dp2", "tp2-clip-users-own-loss", "dp2xtp2-clip", "dp2xtp2-clip-default-kernels"],
)
def test_layout_matches_single_process(dp, tp, clip, kernels, factory, monkeypatch):
    """``kernels``: the ranks' ``ATEN_CPU_CAPABILITY`` (None: the machine's best, as the reference here uses), so
    the suite itself checks that the tolerance holds across kernel sets. Under tp, sequence and loss parallelism are
    on (the default): the residual stream holds half the sequence, the loss is computed from vocabulary shards (of a
    user's own ``F.cross_entropy`` in ``UsersOwnLoss``)."""
    start_method = "forkserver"
    if kernels is not None:  # read by torch at import in each rank: a forkserver's ranks have the server's
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", kernels)
        start_method = "spawn"
    strategy = HybridParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, start_method=start_method)
    actual = _fit(factory(), strategy, dp * tp, dp, gradient_clip_val=clip)
    expected = reference_training(factory, STEPS, PER_RANK_BATCH * dp, clip=clip)
    assert_state_close(actual, expected, STEPS)


class CountForwards(Callback):
    """Counts the training forward calls of sub-module ``name``; rank 0 writes the count to ``path``."""

    def __init__(self, path, name: str) -> None:
        self.path, self.name, self.calls = str(path), name, 0

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.get_submodule(self.name).register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(self.calls, f)


def test_gradient_checkpointing_recomputes_each_block_and_trains_the_same(tmp_path):
    """Each pipeline block's activations are recomputed in backward: a sub-module of a block runs twice per step."""
    counter = CountForwards(tmp_path / "calls.json", "model.layers.0.attn")
    strategy = HybridParallelStrategy(data_parallel_size=2, gradient_checkpointing=True, start_method="forkserver")
    actual = _fit(_tiny(), strategy, 2, 2, callbacks=[counter])
    assert json.loads((tmp_path / "calls.json").read_text()) == 2 * STEPS  # forward, and again in backward
    assert_state_close(actual, reference_training(_tiny, STEPS, PER_RANK_BATCH * 2), STEPS)


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
    return PlainRegression().double()


def test_ddp_module_trains_unchanged_under_ciuic():
    expected = reference_training(_plain, STEPS, PER_RANK_BATCH * 2)
    ours = _fit(_plain(), "ciuic_forkserver", 2, 2)
    ddp = _fit(_plain(), "ddp_spawn", 2, 2)
    assert_state_close(ours, expected, STEPS)
    assert_state_close(ours, ddp, STEPS)
