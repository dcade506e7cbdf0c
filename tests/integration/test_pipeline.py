"""Pipeline parallelism in Lightning's loop: every schedule trains like single-process training."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from examples.deepseek import DeepSeekMini
from lightning_ciuic import CommunicationMonitor, HybridParallelStrategy
from tests.helpers import (
    LOGGED_LOSS_REL, PRECISION, TINY_MODEL, TokenWindows, assert_state_close, loader, reference_training, run_workers,
)

STEPS, PER_RANK_BATCH = 12, 4


class GlobalLoss(DeepSeekMini):
    """Logs the loss averaged over data-parallel replicas: the loss of the global batch, as one process sees it."""

    def training_step(self, batch, batch_idx):
        loss = self.pipelined_loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return GlobalLoss(**TINY_MODEL).double()


def _logged_losses(save_dir: Path) -> list[float]:
    (metrics,) = save_dir.rglob("metrics.csv")
    with metrics.open() as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def fit_pipelined(tmp_path: Path, strategy: HybridParallelStrategy, dp: int, steps: int = STEPS, **trainer_kwargs):
    """Train the tiny model; returns (full state dict handed back to this process, logged per-step losses)."""
    module = _tiny()
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_steps=steps, logger=CSVLogger(tmp_path),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        precision=PRECISION,
        **trainer_kwargs,
    )
    trainer.fit(module, loader(steps * PER_RANK_BATCH * dp, PER_RANK_BATCH))
    return {k: v.detach() for k, v in module.state_dict().items()}, _logged_losses(tmp_path)


SCHEDULES = [
    ("gpipe", None), ("1f1b", None), ("interleaved_1f1b", 2), ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2), ("zbv_zero_bubble", None), ("dualpipev", None),
]


class _LossRecorder(Callback):
    """Records the logged losses; checks that every DTensor gradient is in its parameter's placements when the
    optimizer steps (under sequence parallelism a norm's replicated weight gets Partial shares, which the zero-bubble
    schedules' split weight backward leaves unreduced unless the runner reduces them)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        misplaced = {
            name: p.grad.placements for name, p in pl_module.named_parameters()
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements
        }
        assert not misplaced, f"gradients not in their parameters' placements: {misplaced}"


SCHEDULE_STEPS = 6  # per schedule: float64 tells a wrong gradient from rounding at once; six steps use Adam's moments too


def _every_schedule(rank: int, world: int, dp: int, tp: int, clip) -> None:
    """In already started processes (Lightning sees them as launched externally), train the tiny model with
    every schedule and compare each rank's loss trajectory and stage parameters with single-process training."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    expected_losses: list[float] = []
    expected = reference_training(_tiny, SCHEDULE_STEPS, PER_RANK_BATCH * dp, clip=clip, losses=expected_losses)
    for schedule, stages_per_rank in SCHEDULES:
        strategy = HybridParallelStrategy(
            pipeline_parallel_size=2, data_parallel_size=dp, tensor_parallel_size=tp, pipeline_schedule=schedule,
            stages_per_rank=stages_per_rank, num_microbatches=4 if schedule == "dualpipev" or tp > 1 else 2,
            gradient_checkpointing=schedule == "1f1b",
        )
        module, recorder = _tiny(), _LossRecorder()
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=SCHEDULE_STEPS, logger=False,
            callbacks=[recorder], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            gradient_clip_val=clip, precision=PRECISION,
        )
        trainer.fit(module, loader(SCHEDULE_STEPS * PER_RANK_BATCH * dp, PER_RANK_BATCH))
        assert recorder.losses == pytest.approx(expected_losses, rel=LOGGED_LOSS_REL), schedule
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        assert state.keys() < expected.keys(), f"{schedule}: a stage holds part of the model, under its own names"
        assert_state_close(state, {k: expected[k] for k in state}, SCHEDULE_STEPS)


@pytest.mark.parametrize("dp, tp, clip", [(2, 1, None), (1, 2, 0.05)], ids=["pp2xdp2", "pp2xtp2-sequence-parallel-clip"])
def test_every_schedule_matches_single_process(dp, tp, clip):
    """pp=2 x dp=2 and pp=2 x tp=2 (global-norm clipping; sequence and loss parallelism on, the default: stages
    hand each other half the sequence, the last computes the loss from vocabulary shards) on 4 processes, 6 steps,
    for each schedule offered; 1F1B also with activation checkpointing."""
    run_workers(_every_schedule, 4, dp, tp, clip)


def test_full_model_is_handed_back_after_spawn(tmp_path):
    """With start_method="spawn" the main process gets every stage's trained weights back, and the logged loss
    is the true loss on every rank (the one test of spawn itself; the others fork from a preloaded forkserver)."""
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, start_method="spawn")
    state, losses = fit_pipelined(tmp_path, strategy, dp=2, steps=6)
    expected_losses: list[float] = []
    expected = reference_training(_tiny, 6, PER_RANK_BATCH * 2, losses=expected_losses)
    assert losses == pytest.approx(expected_losses, rel=LOGGED_LOSS_REL)
    assert_state_close(state, expected, 6)


PP2_DP2 = dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
PP1_DP4 = dict(pipeline_parallel_size=1, data_parallel_size=4)
GLOBAL_BATCH = 8


def _fit_layout(layout: dict, dirpath: str, max_steps: int, ckpt_path=None, save_every=None):
    """Train the tiny model in ``layout`` (3 steps per epoch, global batch 8); returns (module, trainer, losses)."""
    per_rank = GLOBAL_BATCH // layout["data_parallel_size"]
    module, recorder = _tiny(), _LossRecorder()
    callbacks = [recorder]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=save_every, save_top_k=-1))
    trainer = Trainer(
        strategy=HybridParallelStrategy(**layout), accelerator="cpu", devices=4, max_steps=max_steps, logger=False,
        callbacks=callbacks, enable_checkpointing=bool(save_every), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=dirpath, precision=PRECISION,
    )
    trainer.fit(module, loader(3 * GLOBAL_BATCH, per_rank), ckpt_path=ckpt_path)
    return module, trainer, recorder.losses


def _resume_across_layouts(rank: int, world: int, tmp: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for first, second in ((PP2_DP2, PP1_DP4), (PP1_DP4, PP2_DP2)):
        dirpath = os.path.join(tmp, f"pp{first['pipeline_parallel_size']}")
        straight, _, losses = _fit_layout(first, dirpath, 6, save_every=3)
        resumed, _, resumed_losses = _fit_layout(second, dirpath, 6, ckpt_path=os.path.join(dirpath, "epoch=0-step=3.ckpt"))
        assert resumed_losses == pytest.approx(losses[3:], rel=LOGGED_LOSS_REL), (first, second)
        options = StateDictOptions(full_state_dict=True)
        a, b = get_model_state_dict(straight, options=options), get_model_state_dict(resumed, options=options)
        common = a.keys() & b.keys()
        assert common, "the layouts share parameters on this rank"
        assert_state_close({k: b[k] for k in common}, {k: a[k] for k in common}, 6)


def test_checkpoint_resumes_in_another_layout(tmp_path):
    """Saved at pp=2 x dp=2, resumed at pp=1 x dp=4, and the other way round: the loss continues as without
    the interruption (same global batch), and the parameters end equal."""
    run_workers(_resume_across_layouts, 4, str(tmp_path))


def _validate_and_predict(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    module, trainer, _ = _fit_layout(PP2_DP2, ".", 3)
    reference = _tiny()
    reference.load_state_dict(reference_training(_tiny, 3, GLOBAL_BATCH))
    data = loader(16, 4)
    (metrics,) = trainer.validate(module, data, verbose=False)
    with torch.no_grad():
        expected = torch.stack([reference.pipelined_loss(batch) for batch in data]).mean()
    assert metrics["val/loss"] == pytest.approx(expected.item(), rel=1e-5)
    # A batch num_microbatches=2 does not divide (3 samples per rank) is evaluated in 1 micro-batch.
    odd = loader(6, 3)
    (metrics,) = trainer.validate(module, odd, verbose=False)
    with torch.no_grad():
        expected = reference.pipelined_loss(odd.dataset[:])
    assert metrics["val/loss"] == pytest.approx(expected.item(), rel=1e-5)
    predictions = torch.cat(trainer.predict(module, data))
    dp_rank = trainer.strategy.device_mesh["dp"].get_local_rank()
    inputs = data.dataset.data[dp_rank::2, :-1]  # Lightning's predict sampler: every dp-th sample, in order
    assert torch.equal(predictions, reference(inputs).argmax(dim=-1))


def test_validate_and_predict_through_the_pipeline():
    run_workers(_validate_and_predict, 4)


def _fit_quietly(module, strategy, data, **kwargs) -> Trainer:
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION, **kwargs,
    )
    trainer.fit(module, data)
    return trainer


class NotPipelined(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].to(self.net.weight.dtype)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _accumulation_pp4_compression_and_setup_errors(rank: int, world: int, tmp: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    # Gradient accumulation: two batches of 4 per rank and optimizer step = one global batch of 16.
    module = _tiny()
    _fit_quietly(module, HybridParallelStrategy(**PP2_DP2), loader(64, 4), max_steps=4, accumulate_grad_batches=2)
    expected = reference_training(_tiny, 4, 16, num_samples=64)
    state = get_model_state_dict(module)
    assert_state_close(state, {k: expected[k] for k in state}, 4)
    # pp=4: the same module, four stages of its five blocks.
    module, recorder = _tiny(), _LossRecorder()
    strategy = HybridParallelStrategy(pipeline_parallel_size=4, num_microbatches=4)
    _fit_quietly(module, strategy, loader(STEPS * 4, 4), max_steps=STEPS, callbacks=[recorder])
    expected_losses: list[float] = []
    expected = reference_training(_tiny, STEPS, 4, losses=expected_losses)
    assert recorder.losses == pytest.approx(expected_losses, rel=LOGGED_LOSS_REL)
    state = get_model_state_dict(module)
    assert_state_close(state, {k: expected[k] for k in state}, STEPS)
    # Compressed gradient synchronization over dp composes with the pipeline; the monitor sees the bubble.
    module, recorder, monitor = _tiny(), _LossRecorder(), CommunicationMonitor(measure_link=False, dirpath=tmp)
    strategy = HybridParallelStrategy(**PP2_DP2, communication_compression="fp16")
    _fit_quietly(module, strategy, loader(STEPS * 8, 4), max_steps=STEPS, callbacks=[recorder, monitor])
    expected_losses = []
    reference_training(_tiny, STEPS, 8, losses=expected_losses)
    assert recorder.losses == pytest.approx(expected_losses, rel=2e-2)
    assert monitor.profile.pp == 2 and monitor.profile.num_microbatches == 2
    assert 0.0 < monitor.profile.bubble < 1.0
    # Bad input fails at set-up, on every rank alike, with what was given and what would work.
    failures = [
        (dict(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", stages_per_rank=2), _tiny,
         ValueError, "has 5 pipeline blocks, fewer than the 8 stages asked for .* use at most 5 stages"),
        (dict(PP2_DP2, num_microbatches=3), _tiny,
         ValueError, r"the DataLoader's batch_size has 4 samples, which num_microbatches=3 does not divide; .* among \[1, 2, 4\]"),
        (dict(pipeline_parallel_size=2, tensor_parallel_size=2), lambda: DeepSeekMini(**dict(TINY_MODEL, n_heads=3)),
         ValueError, "tensor_parallel_size=2 does not divide n_heads=3"),
        (PP2_DP2, NotPipelined, TypeError, "needs a LightningModule that implements the PipelineModule protocol"),
        (dict(data_parallel_size=4, gradient_checkpointing=True), NotPipelined,
         TypeError, "gradient_checkpointing=full acts in each block of the model, and NotPipelined has neither pipeline blocks"),
    ]
    for layout, factory, error, message in failures:
        with pytest.raises(error, match=message):
            _fit_quietly(factory(), HybridParallelStrategy(**layout), loader(16, 4), max_steps=1)
    # Sequence parallelism under pp: the stages hand each other half the sequence, which must split evenly.
    with pytest.raises(ValueError, match=r"have 7 positions, which the 2 tensor-parallel ranks .* divisible by tensor_parallel_size=2"):
        odd = DataLoader(TokenWindows(16, seq_len=7), batch_size=4)
        _fit_quietly(_tiny(), HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), odd, max_steps=1)


def test_accumulation_pp4_compression_and_setup_errors(tmp_path):
    run_workers(_accumulation_pp4_compression_and_setup_errors, 4, str(tmp_path))
