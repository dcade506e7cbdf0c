"""Modules written for other strategies train under ours to the same parameters as one process (float64).

A module written for ``DDPStrategy`` (its steps call sub-modules, never ``forward``) sharded by the strategy; a
module written for ``ModelParallelStrategy`` (its own ``fully_shard`` / ``parallelize_module`` over the mesh axes
named ``data_parallel`` / ``tensor_parallel``) with sharding left at 1; ``tensor_parallel_size`` on a module with no
plan is refused.
"""

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ciuic import HybridParallelStrategy
from tests.helpers import PRECISION, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH, LR = 3, 2, 1e-2


def _mlp(width: int = 16) -> nn.Sequential:
    """Eight linear layers after an embedding of the 8 input tokens."""
    hidden = [m for _ in range(6) for m in (nn.Tanh(), nn.Linear(width, width))]
    return nn.Sequential(nn.Embedding(256, 8), nn.Flatten(), nn.Linear(64, width), *hidden, nn.Tanh(), nn.Linear(width, 256))


class DDPStyleMLP(LightningModule):
    """Written for DDPStrategy: layers built in __init__ (or in configure_model), the step calls ``self.net``,
    AdamW; optionally a bare ``nn.Parameter`` on the LightningModule itself."""

    def __init__(self, build_in_configure_model: bool = False, bare_parameter: bool = False) -> None:
        super().__init__()
        self.build_in_configure_model = build_in_configure_model
        self.net = None if build_in_configure_model else _mlp()
        self.scale = nn.Parameter(torch.ones(256)) if bare_parameter else None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(5)  # the same weights on every rank and in the reference
            self.net = _mlp()

    def _loss(self, batch):
        inputs, targets = batch
        logits = self.net(inputs)
        if self.scale is not None:
            logits = logits * self.scale
        return nn.functional.cross_entropy(logits, targets[:, -1])

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _factory(**kwargs):
    def build() -> DDPStyleMLP:
        seed_everything(5)
        module = DDPStyleMLP(**kwargs)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # as Lightning calls configure_model under precision="64-true"
        try:
            module.configure_model()
        finally:
            torch.set_default_dtype(default)
        return module.double()

    return build


class SaveFullState(Callback):
    """Rank 0 saves the whole trained parameters (built in configure_model, they never reach the main process)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(state, self.path)


def _fit(module: LightningModule, strategy: HybridParallelStrategy, devices: int, dp: int, tmp_path) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        callbacks=[SaveFullState(tmp_path / "state.pt")],
    )
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * dp, PER_RANK_BATCH))
    return torch.load(tmp_path / "state.pt")


@pytest.mark.parametrize(
    "kwargs, units",
    [(dict(), None), (dict(), [nn.Linear]), (dict(build_in_configure_model=True, bare_parameter=True), [nn.Linear])],
    ids=["root-unit-only", "linear-units", "built-in-configure_model-bare-parameter"],
)
def test_a_module_written_for_ddp_trains_sharded_to_the_same_parameters(kwargs, units, tmp_path):
    factory = _factory(**kwargs)
    seed_everything(5)
    module = DDPStyleMLP(**kwargs).double()  # built in __init__: the reference's weights; else in configure_model
    strategy = HybridParallelStrategy(
        data_parallel_size=2, data_parallel_shard_size=2, fsdp_units=units, start_method="forkserver"
    )
    actual = _fit(module, strategy, 2, 2, tmp_path)
    assert_state_close(actual, reference_training(factory, STEPS, PER_RANK_BATCH * 2), STEPS, lr=LR)


class ModelParallelStyleMLP(DDPStyleMLP):
    """Written for ModelParallelStrategy: shards itself in configure_model over the mesh axes it names there."""

    def __init__(self, tensor_parallel: bool = False, width: int = 16) -> None:
        super().__init__()
        self.net = _mlp(width)
        self.tensor_parallel = tensor_parallel

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if self.tensor_parallel:
            parallelize_module(self.net, mesh["tensor_parallel"], {"2": ColwiseParallel(), "4": RowwiseParallel()})
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("tensor_parallel, width", [(False, 16), (False, 7), (True, 16)], ids=["fsdp", "fsdp-odd-shape", "fsdp-tp-aliases"])
def test_a_module_written_for_model_parallel_strategy_gets_the_right_gradients(tensor_parallel, width, tmp_path):
    def reference() -> ModelParallelStyleMLP:
        seed_everything(5)
        return ModelParallelStyleMLP(width=width).double()

    seed_everything(5)
    module = ModelParallelStyleMLP(tensor_parallel, width).double()
    tp = 2 if tensor_parallel else 1
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=tp, start_method="forkserver")
    actual = _fit(module, strategy, 2 * tp, 2, tmp_path)
    expected = reference_training(reference, STEPS, PER_RANK_BATCH * 2)
    for key in expected:  # SGD: no Adam amplification; float64 sums in another order differ by a few ulps
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-12, msg=lambda m, k=key: f"{k}: {m}")


def test_tensor_parallel_on_a_module_without_a_plan_is_refused(tmp_path):
    strategy = HybridParallelStrategy(tensor_parallel_size=2, data_parallel_size=1, start_method="forkserver")
    with pytest.raises(Exception, match=r"tensor_parallel_size=2, but DDPStyleMLP has no tensor-parallel plan"):
        _fit(_factory()(), strategy, 2, 1, tmp_path)
