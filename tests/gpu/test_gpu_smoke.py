"""GPU smoke suite (``make test-gpu``): the NCCL path on CUDA tensors. Skipped where CUDA is absent; the
multi-rank cases need one GPU per rank (NCCL refuses two ranks on one device) and skip below two GPUs.

What a CPU run cannot show: every buffer of the compressed collectives, PowerSGD, ``auto``'s probes, the
gradient norm and error-feedback state follows the gradients onto the GPU, timings come from CUDA events, and
the whole strategy (dp with every compression mode, tp, pp, async checkpoints, snapshot rollback) runs on NCCL.
"""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.deepseek import DeepSeekMini
from lightning_ciuic import AsyncCheckpointer, HybridParallelStrategy, SnapshotRecovery
from lightning_ciuic.wire.codecs import ErrorFeedback, TopK, dense_codec
from lightning_ciuic.wire.timing import DeviceClock
from lightning_ciuic.testing import FailAt
from lightning_ciuic.parallel.grad_norm import total_grad_norm
from lightning_ciuic.plugins.checkpoint_io import Stager
from tests.helpers import TINY_MODEL, ReplicaReport, loader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs one GPU per rank: at least 2 GPUs")
MODES = ["none", "fp16", "bf16", "int8", "nf4", "topk", "powersgd", "auto"]


# -- one GPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8", "nf4"])
def test_codecs_encode_and_decode_on_the_gpu(name):
    x = torch.randn(10_000, device="cuda")
    codec = dense_codec(name)
    data = codec.encode(x)
    assert data.device == x.device and data.numel() == codec.nbytes(x.numel())
    assert codec.decode(data, x.numel()).device == x.device
    indices, values = TopK(0.01).encode(x)
    assert indices.device == values.device == x.device


def test_error_feedback_restored_on_the_cpu_follows_the_gradients():
    feedback = ErrorFeedback()
    feedback.load_state_dict({"b": torch.ones(4)})  # as a checkpoint restores it
    x = torch.zeros(4, device="cuda")
    feedback.compensate_("b", x)
    assert feedback.residuals["b"].device.type == "cuda" and x.tolist() == [1.0] * 4


def test_checkpoint_staging_copies_into_pinned_memory_before_later_kernels_change_the_state():
    state = {"w": torch.randn(4096, 4096, device="cuda"), "step": 7}
    expected = state["w"].cpu()
    stage = Stager()
    staged = stage(state)
    state["w"].mul_(0.0)  # the optimizer step right after the stall: ordered after the copy on the current stream
    stage.synchronize()
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned() and staged["step"] == 7
    assert torch.equal(staged["w"], expected)
    assert stage(state)["w"].data_ptr() == staged["w"].data_ptr()  # reused at the next save
    stage.synchronize()
    assert not staged["w"].any()


def test_a_forward_backward_pairs_helper_thread_computes_on_the_training_threads_stream():
    from lightning_ciuic.parallel.paired_overlap import run_pair

    side_stream, seen = torch.cuda.Stream(), {}
    with torch.cuda.stream(side_stream):
        run_pair(lambda: seen.update(forward=torch.cuda.current_stream()), lambda: seen.update(backward=torch.cuda.current_stream()))
    assert seen == {"forward": side_stream, "backward": side_stream}


def test_grad_norm_stays_on_the_gpu_and_device_clock_times_device_work():
    params = [torch.nn.Parameter(torch.ones(3, device="cuda")) for _ in range(2)]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    assert total_grad_norm(params).item() == pytest.approx(24 ** 0.5)
    clock, seconds = DeviceClock(torch.device("cuda")), []
    a = torch.randn(4096, 4096, device="cuda")
    start = clock.mark()
    for _ in range(10):
        a = a @ a / 64
    clock.add(start, clock.mark(), seconds.append)
    clock.collect(wait=True)
    assert len(seconds) == 1 and seconds[0] > 0


# -- one GPU per rank --------------------------------------------------------------------------------
def _fit(tmp_path, strategy, steps=8, callbacks=(), ckpt_path=None, devices=2, **trainer_kwargs):
    seed_everything(7)
    tmp_path.mkdir(parents=True, exist_ok=True)
    report = ReplicaReport(tmp_path / "report.json")
    Trainer(
        accelerator="gpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[report, *callbacks], **trainer_kwargs,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    ).fit(DeepSeekMini(**TINY_MODEL), loader(16 * 2 * 4, 4), ckpt_path=ckpt_path)
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_strategy_on_one_gpu_trains_as_lightnings_ddp(tmp_path, precision):
    """World 1 over NCCL: the strategy's set-up, engine and step routing leave the maths of Lightning's DDP on one
    GPU (the same shuffling DistributedSampler deals the batches)."""
    ours = _fit(tmp_path / "ours", HybridParallelStrategy(), devices=1, precision=precision)
    plain = _fit(tmp_path / "plain", "ddp", devices=1, precision=precision)
    assert len(ours["losses"]) == 8 and ours["losses"][-1] < ours["losses"][0]
    torch.testing.assert_close(ours["losses"], plain["losses"], rtol=1e-5, atol=1e-6)


def test_an_async_checkpoint_on_one_gpu_resumes_the_run_it_cut(tmp_path):
    url = str(tmp_path / "checkpoints")
    saver = lambda: AsyncCheckpointer(url, save_interval=None, every_n_train_steps=4)  # noqa: E731
    straight = _fit(tmp_path / "straight", HybridParallelStrategy(), devices=1, steps=8)
    _fit(tmp_path / "cut", HybridParallelStrategy(), devices=1, steps=4, callbacks=[saver()])
    resumed = _fit(tmp_path / "cut", HybridParallelStrategy(), devices=1, steps=8, ckpt_path="last", callbacks=[saver()])
    assert resumed["losses"] == straight["losses"][4:]  # steps 5..8, bit-equal on the same GPU


@two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_dp2_trains_with_every_compression_mode_over_nccl(tmp_path, mode):
    strategy = HybridParallelStrategy(data_parallel_size=2, communication_compression=mode, start_method="spawn")
    report = _fit(tmp_path, strategy, steps=40 if mode == "auto" else 8, gradient_clip_val=1.0)
    assert report["replicas_identical"] and sum(report["losses"][-3:]) / 3 < report["losses"][0]


@two_gpus
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2, num_microbatches=2)])
def test_tp2_and_pp2_train_over_nccl(tmp_path, layout):
    report = _fit(tmp_path, HybridParallelStrategy(**layout, start_method="spawn"), gradient_clip_val=1.0)
    assert sum(report["losses"][-3:]) / 3 < report["losses"][0]


@two_gpus
def test_async_checkpoint_resumes_and_a_snapshot_rolls_back_over_nccl(tmp_path):
    url = str(tmp_path / "checkpoints")
    strategy = lambda: HybridParallelStrategy(data_parallel_size=2, start_method="spawn")  # noqa: E731
    _fit(tmp_path, strategy(), steps=4, callbacks=[AsyncCheckpointer(url, save_interval=None, every_n_train_steps=4)])
    resumed = _fit(tmp_path, strategy(), steps=8, ckpt_path="last",
                   callbacks=[AsyncCheckpointer(url, save_interval=None, every_n_train_steps=4)])
    assert len(resumed["losses"]) == 4  # steps 5..8 after the resume
    recovery = SnapshotRecovery(snapshot_freq=2, store="memory", check_gradients=True)
    report = _fit(tmp_path, strategy(), steps=8, callbacks=[recovery, FailAt(5, "nan", ranks=(1,))])
    assert report["replicas_identical"] and all(loss == loss for loss in report["losses"][-3:])  # finite after the rollback


@two_gpus
def test_sync_batchnorm_statistics_are_the_global_batchs_over_nccl():
    from lightning.pytorch import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    class WithBatchNorm(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(32)

        def forward(self, x):
            return self.layer(self.norm(x))

    class Report(Callback):
        def on_train_end(self, trainer, pl_module):
            trainer.callback_metrics["synced"] = torch.tensor(float(isinstance(pl_module.norm, torch.nn.SyncBatchNorm)))
            trainer.callback_metrics["running_mean"] = pl_module.norm.running_mean.detach().cpu().clone()

    seed_everything(1)
    data = RandomDataset(32, 8)
    trainer = Trainer(
        strategy=HybridParallelStrategy(start_method="spawn"), accelerator="cuda", devices=2, max_steps=1,
        sync_batchnorm=True, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[Report()],
    )
    trainer.fit(WithBatchNorm(), DataLoader(data, batch_size=4, shuffle=False))
    assert trainer.callback_metrics["synced"] == 1
    # One step over both ranks' 4 samples: the statistics of all 8 (momentum 0.1 from a zero running mean).
    torch.testing.assert_close(trainer.callback_metrics["running_mean"], 0.1 * data.data.mean(dim=0), rtol=1e-4, atol=1e-5)
