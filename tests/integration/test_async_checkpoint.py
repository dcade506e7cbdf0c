"""AsyncCheckpointer through Lightning: resume from "last" under dp, dp x tp, FSDP and DDP, also into another
layout (data-parallel size, tensor parallelism, sharded <-> replicated), ending where one process trained without
interruption ends (float64); and a real kill -9 in the middle of a background save."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.deepseek import DeepSeekMini
from lightning_ciuic import AsyncCheckpointer, ChunkedCheckpointIO, HybridParallelStrategy
from lightning_ciuic.checkpoint.incremental import CheckpointCatalog
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader, reference_training

GLOBAL_BATCH, STEPS_PER_EPOCH = 4, 4


def _tiny():
    seed_everything(7)
    return DeepSeekMini(**TINY_MODEL).double()


def _fit(strategy, devices, max_steps, url=None, ckpt_path=None, every=STEPS_PER_EPOCH, saver=None):
    module = _tiny()
    callbacks = [saver or AsyncCheckpointer(url, save_interval=None, every_n_train_steps=every)] if url else []
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(url),
        precision=PRECISION,
    )
    requested = strategy.parallelism.degrees if isinstance(strategy, HybridParallelStrategy) else {}
    dp = requested.get("data_parallel_size", devices)
    dp = devices if dp == "auto" else dp
    trainer.fit(module, loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH // dp), ckpt_path=ckpt_path)
    return {k: v.detach() for k, v in module.state_dict().items()}


def _ciuic(dp, tp=1, shard=1, pp=1, zero=None):
    return HybridParallelStrategy(
        data_parallel_size=dp, tensor_parallel_size=tp, data_parallel_shard_size=shard, pipeline_parallel_size=pp,
        num_microbatches=2, zero_stage=zero, start_method="forkserver",
    )


@pytest.mark.parametrize(
    "save_layout, resume_layout",  # (dp, tp, dp_shard, pp[, zero_stage])
    [  # (dp 2 -> dp 4 is in dp2-to-hsdp2x2: another data-parallel size, and replicated to sharded)
        ((2, 2, 2, 1), (4, 1, 4, 1)), ((4, 1, 1, 1), (1, 2, 1, 1)), ((2, 1, 2, 2), (4, 1, 1, 1)), ((2, 1, 1, 1), (4, 1, 2, 1)),
        ((1, 1, 1, 2), (1, 1, 1, 2)),  # each stage's optimizer groups name its own parameters (was: another stage's)
        ((2, 1, 2, 2, 3), (2, 1, 2, 2, 1)), ((2, 1, 2, 1, 1), (2, 1, 2, 1, 3)),  # across ZeRO stages
    ],
    ids=[
        "fsdp2xtp2-to-fsdp4", "dp4-to-tp2", "fsdp2xpp2-to-dp4", "dp2-to-hsdp2x2", "pp2-to-pp2",
        "fsdp2xpp2-zero3-to-zero1", "fsdp2-zero1-to-zero3",
    ],
)
def test_resume_from_last_continues_exactly(tmp_path, save_layout, resume_layout):
    url = str(tmp_path / "checkpoints")
    (dp, tp, shard, pp, *zero), (dp2, tp2, shard2, pp2, *zero2) = save_layout, resume_layout
    _fit(_ciuic(dp, tp, shard, pp, *zero), dp * tp * pp, STEPS_PER_EPOCH, url)
    resumed = _fit(_ciuic(dp2, tp2, shard2, pp2, *zero2), dp2 * tp2 * pp2, 2 * STEPS_PER_EPOCH, url, ckpt_path="last")
    uninterrupted = reference_training(_tiny, 2 * STEPS_PER_EPOCH, GLOBAL_BATCH, num_samples=STEPS_PER_EPOCH * GLOBAL_BATCH)
    assert_state_close(resumed, uninterrupted, 2 * STEPS_PER_EPOCH)
    manifests = CheckpointCatalog(ChunkedCheckpointIO(url).store).manifests()
    assert [m.step for m in manifests] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert manifests[0].world_size == dp * tp * pp


@pytest.mark.parametrize("checkpointer", ["AsyncCheckpointer", "ModelCheckpoint"])
def test_a_checkpoint_saved_mid_epoch_resumes_at_the_next_batch(tmp_path, checkpointer):
    """Without SnapshotRecovery too: the strategy keeps every map-style training loader's position, so a resume
    from any checkpoint continues the epoch (it restarted the epoch's data at its first batch while counting on)."""
    url, half = str(tmp_path / "checkpoints"), STEPS_PER_EPOCH // 2
    saver = lambda: ModelCheckpoint(url, every_n_train_steps=half, save_last=True) if checkpointer == "ModelCheckpoint" else None  # noqa: E731
    _fit(HybridParallelStrategy(), 1, half, url, every=half, saver=saver())
    ckpt_path = str(Path(url) / "last.ckpt") if checkpointer == "ModelCheckpoint" else "last"
    resumed = _fit(HybridParallelStrategy(), 1, STEPS_PER_EPOCH + half, url, ckpt_path=ckpt_path, every=half, saver=saver())
    uninterrupted = reference_training(_tiny, STEPS_PER_EPOCH + half, GLOBAL_BATCH, num_samples=STEPS_PER_EPOCH * GLOBAL_BATCH)
    assert_state_close(resumed, uninterrupted, STEPS_PER_EPOCH + half)


def test_ddp_strategy_resumes_exactly(tmp_path):
    url = f"file://{tmp_path}/checkpoints"
    _fit("ddp_spawn", 2, STEPS_PER_EPOCH, url)
    resumed = _fit("ddp_spawn", 2, 2 * STEPS_PER_EPOCH, url, ckpt_path="last")
    uninterrupted = reference_training(_tiny, 2 * STEPS_PER_EPOCH, GLOBAL_BATCH, num_samples=STEPS_PER_EPOCH * GLOBAL_BATCH)
    assert_state_close(resumed, uninterrupted, 2 * STEPS_PER_EPOCH)


class FrozenEmbedding(DeepSeekMini):
    """The tiny model with its embedding and head frozen: their chunks do not change between saves."""

    def configure_optimizers(self):
        for module in (self.model.embed, self.model.head):
            module.weight.requires_grad_(False)
        return super().configure_optimizers()


def _second_save(url: str, incremental: bool):
    """Two saves of the model with frozen embedding and head (steps 2 and 4); the second one's manifest and the
    frozen bytes."""
    seed_everything(7)
    module = FrozenEmbedding(**TINY_MODEL).double()
    saver = AsyncCheckpointer(url, save_interval=None, every_n_train_steps=2, incremental=incremental)
    Trainer(
        strategy=_ciuic(2), accelerator="cpu", devices=2, max_steps=4, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[saver], precision=PRECISION,
    ).fit(module, loader(4 * GLOBAL_BATCH, GLOBAL_BATCH // 2))
    first, second = CheckpointCatalog(ChunkedCheckpointIO(url).store).manifests()
    assert second.logical_bytes == first.logical_bytes
    return second, sum(m.weight.numel() * m.weight.element_size() for m in (module.model.embed, module.model.head))


def test_incremental_reuses_unchanged_chunks_and_false_rewrites_them(tmp_path):
    reused, frozen = _second_save(str(tmp_path / "incremental"), incremental=True)
    rewritten, _ = _second_save(str(tmp_path / "full"), incremental=False)
    # The frozen weights are hashed, found stored, and not written again; incremental=False writes them again
    # (zstd-compressed: float64 weights of a normal init shrink to about 60%).
    assert rewritten.written_bytes - reused.written_bytes >= 0.5 * frozen
    assert reused.written_bytes <= reused.logical_bytes - frozen


TRAIN_FOREVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from lightning.pytorch import Trainer, seed_everything
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic import AsyncCheckpointer
    from lightning_ciuic.checkpoint.storage import Storage
    from tests.helpers import TINY_MODEL, loader

    slow_write = Storage.write_atomic
    def write_slowly(self, relative, data):  # a slow disk: every chunk takes a while
        time.sleep(0.05)
        slow_write(self, relative, data)
    Storage.write_atomic = write_slowly

    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=10_000, logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      callbacks=[AsyncCheckpointer({url!r}, save_interval=None, every_n_train_steps=1, max_keep=3)])
    trainer.fit(DeepSeekMini(**TINY_MODEL), loader(64, 4))
    """
)


def test_kill_9_during_a_save_leaves_every_earlier_checkpoint_loadable(tmp_path):
    url = str(tmp_path / "checkpoints")
    script = tmp_path / "train.py"
    script.write_text(TRAIN_FOREVER.format(root=str(Path(__file__).resolve().parents[2]), url=url))
    log = open(tmp_path / "train.log", "w")
    process = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT)
    io = ChunkedCheckpointIO(url)
    catalog = CheckpointCatalog(io.store)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait for two commits and a third save half-written
            manifests = catalog.manifests() if Path(url, "checkpoints").exists() else []
            referenced = {c for m in manifests for c in m.chunks}
            in_flight = Path(url, "chunks").exists() and bool(io.store.all_chunks() - referenced)
            if len(manifests) >= 2 and in_flight:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"no save in flight seen; training log:\n{(tmp_path / 'train.log').read_text()[-3000:]}")
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
        log.close()
    manifests = catalog.manifests()
    assert len(manifests) >= 2
    for manifest in manifests:
        catalog.verify(manifest)  # every committed checkpoint is intact
    assert "state_dict" in io.load_checkpoint("last")
    assert catalog.sweep_orphans() > 0  # the half-written save's chunks, now removed
    assert io.store.all_chunks() == {c for m in catalog.manifests() for c in m.chunks}
