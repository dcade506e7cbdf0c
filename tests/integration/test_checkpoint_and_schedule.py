"""Through the Trainer: DCP checkpoints resume exactly, accumulation syncs once per optimizer step, and the
warmup-cosine callback drives the LR (and resumes with it)."""

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy, WarmupCosineSchedule, warmup_cosine_lr
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, assert_state_equal, loader, reference_training


class Record(Callback):
    """Writes what each optimizer step saw (LR) and the synchronizer's collective count to a JSON file."""

    def __init__(self, path):
        self.path, self.lrs = str(path), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module):
        strategy, rank = trainer.strategy, trainer.global_rank
        collectives = {
            "mean": strategy.reduce(torch.tensor(float(rank)), reduce_op="mean").item(),
            "sum": strategy.reduce(torch.tensor(rank), reduce_op="sum").item(),
            "max": strategy.reduce(torch.tensor(rank), reduce_op="max").item(),
            "gathered": strategy.all_gather(torch.tensor([rank])).flatten().tolist(),
            "broadcast": strategy.broadcast(f"from {rank}", src=0),
        }
        if trainer.is_global_zero:
            sync = strategy.data_parallel.synchronizer
            record = {"lrs": self.lrs, "collectives": sync.stats.collectives, "buckets": len(sync.buckets), **collectives}
            with open(self.path, "w") as f:
                json.dump(record, f)


def _tiny():
    seed_everything(11)
    return DeepSeekMini(**TINY_MODEL).double()


def _trainer(tmp_path, max_steps, callbacks, **kwargs):
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="forkserver")
    return Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
        precision=PRECISION,
        **kwargs,
    )


def test_save_and_exact_resume_with_schedule(tmp_path):
    data = loader(3 * 2 * 2, 2)  # 3 steps per epoch: the checkpoint at step 3 closes epoch 0
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    straight = _tiny()
    _trainer(tmp_path, 6, [checkpoints, WarmupCosineSchedule(warmup_ratio=0.34), Record(tmp_path / "a.json")]).fit(straight, data)
    step3 = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert (step3 / ".metadata").is_file() and any(step3.glob("*.distcp")), "a DCP directory with sharded files"

    resumed = _tiny()
    trainer = _trainer(tmp_path, 6, [WarmupCosineSchedule(warmup_ratio=0.34), Record(tmp_path / "b.json")])
    trainer.fit(resumed, data, ckpt_path=str(step3))
    assert_state_equal(resumed.state_dict(), straight.state_dict())

    lrs = json.loads((tmp_path / "a.json").read_text())["lrs"]
    expected = [warmup_cosine_lr(t, TINY_MODEL["lr"], 2, 6, TINY_MODEL["lr"] * 0.01) for t in range(6)]
    assert lrs == pytest.approx(expected)
    assert json.loads((tmp_path / "b.json").read_text())["lrs"] == pytest.approx(expected[3:])


def test_accumulation_syncs_once_per_optimizer_step_with_linearly_scaled_lr(tmp_path):
    module = _tiny()
    data = loader(2 * 3 * 2 * 2, 2)
    # effective batch = 2 per rank x 3 micro-steps x 2 replicas = 12; reference 4 -> peak LR x3
    schedule = WarmupCosineSchedule(scale_lr_with_batch="linear", reference_batch_size=4, batch_size=2)
    _trainer(tmp_path, 2, [schedule, Record(tmp_path / "r.json")], accumulate_grad_batches=3).fit(module, data)
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["collectives"] == 2 * record["buckets"]  # 6 backward passes, 2 synchronizations
    peak = 3 * TINY_MODEL["lr"]
    lr_at = lambda t: warmup_cosine_lr(t, peak, 0, 2, peak * 0.01)  # noqa: E731
    assert record["lrs"][::3] == pytest.approx([lr_at(0), lr_at(1)])
    expected = reference_training(_tiny, 2, 3 * 2 * 2, lr_at=lr_at)
    assert_state_close(module.state_dict(), expected, steps=2, lr=3 * TINY_MODEL["lr"])
    # the strategy's collectives over the 4 ranks
    assert record["mean"] == 1.5 and record["sum"] == 6 and record["max"] == 3
    assert record["gathered"] == [0, 1, 2, 3] and record["broadcast"] == "from 0"


@pytest.mark.parametrize(
    "content, message",
    [({"weights": {}}, r"model.ckpt is not a Lightning checkpoint \(no 'state_dict' in it\)"),
     ({"state_dict": {"head.weight": torch.zeros(1)}}, r"the checkpoint is of another model: \d+ of this model's tensors are not in it .* holds 1 this model does not have \['head.weight'\]")],
    ids=["not-lightning", "another-model"],
)
def test_loading_a_file_that_is_not_this_models_checkpoint_says_so(tmp_path, content, message):
    bogus = tmp_path / "model.ckpt"
    torch.save(content, bogus)
    trainer = Trainer(  # two processes: the check is the same on every rank, no need to start four
        strategy=HybridParallelStrategy(start_method="forkserver"), accelerator="cpu", devices=2, max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, precision=PRECISION,
    )
    with pytest.raises(Exception, match=message):
        trainer.fit(_tiny(), loader(8, 2), ckpt_path=str(bogus))
