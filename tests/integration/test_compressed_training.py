"""Compressed gradient synchronization through the Trainer: every mode trains, replicas stay identical,
uncompressed ring/tree match single-process training, residuals survive a checkpoint resume."""

import csv
import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from examples.deepseek import DeepSeekMini
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.comm.auto import CANDIDATES, SETTLE_STEPS, TRIAL_STEPS
from tests.helpers import PRECISION, TINY_MODEL, ReplicaReport, assert_state_close, assert_state_equal, loader, reference_training

STEPS = 8
AUTO_STEPS = SETTLE_STEPS + len(CANDIDATES) * TRIAL_STEPS + 2  # settle, try every candidate, decide


class Report(ReplicaReport):
    """The replica report plus what the synchronizer counted."""

    def extra(self, trainer):
        engine = trainer.strategy.data_parallel
        compression, auto = getattr(engine, "compression", None), getattr(engine, "auto", None)  # Replicated's parts
        return {
            "bytes_sent": engine.stats.bytes_sent,
            "gradient_bytes": engine.stats.bytes_reduced,
            "active_mode": compression.active_mode if compression else "none",
            "auto": [d.reason for d in auto.history] if auto else [],
        }


def _tiny():
    seed_everything(5)
    return DeepSeekMini(**TINY_MODEL)


def _fit(tmp_path, module, steps=STEPS, callbacks=(), ckpt_path=None, logger=False, precision="32-true", **strategy_kwargs):
    strategy = HybridParallelStrategy(data_parallel_size=2, start_method="forkserver", **strategy_kwargs)
    report = tmp_path / "report.json"
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=logger, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=tmp_path, callbacks=[Report(report), *callbacks], precision=precision,
    )
    trainer.fit(module, loader(4 * 2 * 2, 2), ckpt_path=ckpt_path)
    return json.loads(report.read_text())


class DropResiduals(Callback):
    """Forgets the error-feedback residuals a resume restored (what a resume that did not save them would do)."""

    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.data_parallel
        assert engine.state_dict(), "the resume restored residuals"
        engine.load_state_dict({})


def saved_items(state, prefix=""):
    """(dotted key, tensor) of every tensor in a nested checkpoint dictionary."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from saved_items(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


@pytest.mark.parametrize(
    "kwargs",
    [
        {"communication_compression": "fp16"},
        {"communication_compression": "bf16", "allreduce_algorithm": "ring"},
        {"communication_compression": "int8"},
        {"communication_compression": "nf4"},
        {"communication_compression": "topk", "compression_ratio": 0.05},
        {"communication_compression": "powersgd", "powersgd_rank": 2},
        {"communication_compression": "auto", "auto_recheck_steps": 100},
    ],
    ids=lambda kw: "-".join(str(v) for v in kw.values()),
)
def test_every_mode_trains_and_keeps_replicas_identical(tmp_path, kwargs):
    auto = kwargs["communication_compression"] == "auto"
    report = _fit(tmp_path, _tiny(), steps=AUTO_STEPS if auto else STEPS, **kwargs)
    losses = report["losses"]
    assert report["replicas_identical"]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    assert report["bytes_sent"] > 0
    if auto:
        (reason,) = report["auto"]
        assert "communication_compression='auto' chose" in reason and "measured step time" in reason
        assert all(mode in reason for mode in ("none", "fp16", "int8", "nf4"))
    if kwargs["communication_compression"] in ("int8", "nf4", "topk"):
        limit = {"int8": 0.27, "nf4": 0.15, "topk": 0.11}[kwargs["communication_compression"]]
        # one rank of two sends half of what a ring all-reduce of float32 would: 2 (w-1)/w = 1
        assert report["bytes_sent"] <= limit * report["gradient_bytes"] * 1.05


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_uncompressed_ring_and_tree_match_single_process(tmp_path, algorithm):
    module = _tiny().double()
    _fit(tmp_path, module, steps=4, allreduce_algorithm=algorithm, precision=PRECISION)
    expected = reference_training(lambda: _tiny().double(), 4, 2 * 2)
    assert_state_close(module.state_dict(), expected, 4)


def test_warmup_steps_stay_uncompressed(tmp_path):
    report = _fit(tmp_path, _tiny(), steps=3, communication_compression="int8", compression_warmup_steps=100)
    assert report["active_mode"] == "none"
    assert report["bytes_sent"] == pytest.approx(report["gradient_bytes"], rel=0.01)


@pytest.mark.parametrize("shard, residual", [(1, "residual."), (2, "reduce_scatter.")], ids=["replicated", "sharded"])
def test_int8_resumes_with_its_residuals(tmp_path, shard, residual):
    """float64, bit for bit: the residuals (replicated buckets', or the sharded reduce-scatters') are in the
    checkpoint and a resume from it continues exactly; dropping them after loading does not."""
    layout = dict(communication_compression="int8", data_parallel_shard_size=shard, precision=PRECISION)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    straight = _tiny().double()
    logger = CSVLogger(tmp_path, name="logs")
    _fit(tmp_path, straight, callbacks=[checkpoints], logger=logger, **layout)
    step4 = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    dcp_to_torch_save(step4, tmp_path / "step4.pt")
    state = torch.load(tmp_path / "step4.pt", weights_only=False)
    for rank in (0, 1):  # each rank's error-feedback residuals are in the checkpoint, and not zero
        dims = ParallelismConfig(data_parallel_size=2, data_parallel_shard_size=shard).resolve(2)
        key = f"rank{rank}_{dims.layout_key(rank)}_state.{residual}"
        residuals = [v for k, v in saved_items(state) if k.startswith(key)]
        assert residuals and all(r.abs().sum() > 0 for r in residuals), f"rank {rank}'s residuals"
    resumed = _tiny().double()
    _fit(tmp_path, resumed, ckpt_path=str(step4), **layout)
    assert_state_equal(resumed.state_dict(), straight.state_dict())
    forgetful = _tiny().double()  # the same resume with the residuals dropped after loading: not the same run
    _fit(tmp_path, forgetful, ckpt_path=str(step4), callbacks=[DropResiduals()], **layout)
    assert any(not torch.equal(forgetful.state_dict()[k], v) for k, v in straight.state_dict().items())

    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("comm/bytes_sent")]
    assert len(rows) >= STEPS - 2
    assert all(float(r["comm/bytes_sent"]) > 0 and float(r["comm/sync_time"]) >= 0 for r in rows)
