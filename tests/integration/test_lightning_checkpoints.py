"""Checkpoints a Lightning user can use: a run where nothing is sharded writes Lightning's single file
(``load_from_checkpoint`` and ``torch.load`` read it); hooks see and edit ``state_dict`` / ``optimizer_states`` on
save and on load, in both formats; ``strict_loading`` decides whether another architecture's checkpoint loads;
saving has no side effect on the optimizer."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.cli import checkpoint_command
from lightning_ciuic.checkpoint.sharded import optimizer_state, optimizer_state_by_name
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader


class SaveAtEnd(Callback):
    """Every rank saves ``path`` at the end of training (a collective under sharding)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


class Hooks(Callback):
    """Records what the save and load hooks saw (rank 0, in a file) and edits the saved dict."""

    def __init__(self, path) -> None:
        self.path = path

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["my_callback"] = {"saw": sorted(k for k in ("state_dict", "optimizer_states") if k in checkpoint)}

    def on_train_end(self, trainer, pl_module):  # callback_metrics come back from spawned ranks
        trainer.callback_metrics["steps"] = torch.tensor(float(trainer.global_step))

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        seen = {
            "state_dict": sorted(checkpoint.get("state_dict", {})),
            "optimizer_states": len(checkpoint.get("optimizer_states", [])),
            "mine": checkpoint.get("my_callback"),
        }
        if trainer.is_global_zero:
            torch.save(seen, self.path)


def _trainer(tmp_path, devices=2, steps=2, save=None, precision="32-true", **strategy):
    return Trainer(
        precision=precision,
        strategy=HybridParallelStrategy(start_method="forkserver", **strategy), accelerator="cpu", devices=devices,
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[Hooks(tmp_path / "seen.pt"), *([SaveAtEnd(save)] if save else [])],
    )


@pytest.mark.parametrize("strategy, single_file", [(dict(), True), (dict(data_parallel_shard_size=2), False)], ids=["replicated", "sharded"])
def test_checkpoints_carry_lightnings_state_to_hooks_in_both_formats(tmp_path, strategy, single_file, capfd):
    path = tmp_path / "x.ckpt"
    _trainer(tmp_path, save=path, **strategy).fit(BoringModel())
    captured = capfd.readouterr()
    told = (captured.out + captured.err).count(f"lightning-ciuic checkpoint export {path} {tmp_path / 'x'}-whole.ckpt")
    assert path.is_file() is single_file and path.is_dir() is not single_file
    if single_file:  # what DDPStrategy writes: torch.load and load_from_checkpoint read it
        saved = torch.load(path, weights_only=False)
        assert saved["my_callback"] == {"saw": ["optimizer_states", "state_dict"]} and saved["global_step"] == 2
        loaded = BoringModel.load_from_checkpoint(path)
        torch.testing.assert_close(loaded.layer.weight, saved["state_dict"]["layer.weight"])
        assert told == 0
    else:  # a DCP directory: `lightning-ciuic checkpoint export DIR OUT` makes it one file load_from_checkpoint reads
        assert told == 1  # said once, by rank zero, at the first sharded save
        with pytest.raises(IsADirectoryError):  # Lightning opens the path before any code of ours runs
            BoringModel.load_from_checkpoint(path)
        assert checkpoint_command(["export", str(path), str(tmp_path / "whole.ckpt")]) == 0
        saved = torch.load(tmp_path / "whole.ckpt", weights_only=False)
        assert saved["my_callback"] == {"saw": ["optimizer_states", "state_dict"]} and saved["global_step"] == 2
        assert sorted(saved["state_dict"]) == ["layer.bias", "layer.weight"] and len(saved["optimizer_states"]) == 1
        loaded = BoringModel.load_from_checkpoint(tmp_path / "whole.ckpt")
        torch.testing.assert_close(loaded.layer.weight, saved["state_dict"]["layer.weight"])
    resumed = _trainer(tmp_path, steps=3, **strategy)
    resumed.fit(BoringModel(), ckpt_path=str(path))
    assert resumed.callback_metrics["steps"] == 3
    seen = torch.load(tmp_path / "seen.pt")
    assert seen == {"state_dict": ["layer.bias", "layer.weight"], "optimizer_states": 1, "mine": {"saw": ["optimizer_states", "state_dict"]}}


class Wider(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("strategy", [dict(), dict(data_parallel_shard_size=2)], ids=["single-file", "dcp"])
def test_a_checkpoint_of_another_architecture_fails_unless_strict_loading_is_off(tmp_path, strategy):
    _trainer(tmp_path, save=tmp_path / "wider.ckpt", **strategy).fit(Wider())
    with pytest.raises(Exception, match=r"the checkpoint is of another model: 0 of this model's tensors are not in it \[\], and it holds 2 this model does not have \['extra.bias', 'extra.weight'\]"):
        _trainer(tmp_path, steps=3, **strategy).fit(BoringModel(), ckpt_path=str(tmp_path / "wider.ckpt"))
    lenient = BoringModel()
    lenient.strict_loading = False
    resumed = _trainer(tmp_path, steps=3, **strategy)
    resumed.fit(lenient, ckpt_path=str(tmp_path / "wider.ckpt"))
    assert resumed.callback_metrics["steps"] == 3


def test_reading_the_optimizer_state_runs_no_step_and_keeps_every_gradient():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    calls = []
    optimizer.zero_grad = lambda *a, **k: calls.append("zero_grad")  # type: ignore[method-assign]
    state = optimizer_state(model, optimizer)
    assert state["state"] == {} and not optimizer.state and calls == []  # no fake step: Adam's step stays 0
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 3)).sum().backward()  # inside an accumulation window
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer_state(model, optimizer)
    assert calls == [] and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


class LearningRate(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.1

    def configure_optimizers(self):  # no LR scheduler
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_lr_find_on_a_model_without_a_scheduler_restores_its_state(tmp_path):
    from lightning.pytorch.tuner import Tuner

    trainer = Trainer(
        strategy=HybridParallelStrategy(), accelerator="cpu", devices=1, max_steps=5, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )
    model = LearningRate()
    before = model.layer.weight.detach().clone()
    result = Tuner(trainer).lr_find(model, num_training=10, update_attr=False, early_stop_threshold=None)  # all 10 trials
    assert len(result.results["lr"]) == 10
    torch.testing.assert_close(model.layer.weight.detach(), before)  # lr_find's trial steps were rolled back


def test_a_stage_maps_a_single_files_optimizer_positions_by_the_saved_tensors_or_refuses():
    """A pipeline stage's optimizer holds part of the parameters: the positions of a whole run's optimizer state are
    named by the checkpoint's tensors where they are as many, and refused (saying what would work) where buffers
    make that ambiguous."""
    whole = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adam(whole.parameters())
    whole(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    stage = torch.nn.Sequential(torch.nn.Linear(2, 2))  # the first stage: "0.weight", "0.bias"
    stage_optimizer = torch.optim.Adam(stage.parameters())
    named = optimizer_state_by_name(stage, stage_optimizer, saved, whole.state_dict().keys())
    assert sorted(named["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    torch.testing.assert_close(named["state"]["1.weight"]["exp_avg"], optimizer.state[whole[1].weight]["exp_avg"])
    with_buffers = [*whole.state_dict().keys(), "2.running_mean"]
    with pytest.raises(ValueError, match="keyed by position .4 parameters. and this rank's optimizer holds 2"):
        optimizer_state_by_name(stage, stage_optimizer, saved, with_buffers)


class PlainSGDMini(DeepSeekMini):
    """The example model under plain SGD: an optimizer that holds no per-parameter state."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _sgd_fit(tmp_path, steps, devices, ckpt_path=None, save=None, **strategy):
    seed_everything(3)
    module = PlainSGDMini(**TINY_MODEL).double()
    trainer = _trainer(tmp_path, devices=devices, steps=steps, save=save, precision=PRECISION, **strategy)
    trainer.fit(module, loader(8, 2), ckpt_path=ckpt_path)  # an epoch of 2 steps: saved at its end, resumed at the next
    return {k: v.detach() for k, v in module.state_dict().items()}


def test_an_optimizer_without_state_resumes_into_another_layout(tmp_path):
    """A dp 2 single file into dp 2 x tp 2 with plain SGD: torch's whole-state optimizer loading asserted ("Expected
    device to be set") on an optimizer with no tensors; now it loads, and trains on as the same file resumed at
    dp 2 does."""
    saved = tmp_path / "dp2.ckpt"
    _sgd_fit(tmp_path, 2, 2, save=saved, data_parallel_size=2)
    into_tp = _sgd_fit(tmp_path, 4, 4, ckpt_path=str(saved), data_parallel_size=2, tensor_parallel_size=2)
    same_layout = _sgd_fit(tmp_path, 4, 2, ckpt_path=str(saved), data_parallel_size=2)
    assert_state_close(into_tp, same_layout, steps=2, lr=0.05)
