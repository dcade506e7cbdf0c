"""DiLoCo through a Trainer: with a sync every step and a plain outer SGD step it is data-parallel training (float64);
replicas diverge inside a round and agree bit for bit after each; a run resumed mid-round continues exactly; int8
outer gradients keep their residuals."""

import json

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.deepseek import DeepSeekMini
from lightning_ciuic import CommunicationMonitor, DiLoCo, HybridParallelStrategy, parallel_context
from lightning_ciuic.tensors import local_tensor
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, assert_state_equal, loader, reference_training

PER_RANK_BATCH = 2


class SGDMini(DeepSeekMini):
    """The tiny model with plain SGD inside: one inner step is then exactly ``-lr * gradient``."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _tiny(cls=DeepSeekMini, **changes):
    seed_everything(7)
    return cls(**{**TINY_MODEL, **changes}).double()


class ReplicasAgree(Callback):
    """Rank 0 writes, per optimizer step, whether every data-parallel replica holds rank 0's parameters."""

    def __init__(self, path) -> None:
        self.path, self.agree, self.replicas = str(path), [], []

    @staticmethod
    def _replicas(trainer, pl_module) -> torch.Tensor:
        flat = torch.cat([local_tensor(p).detach().reshape(-1) for p in pl_module.parameters()])
        copies = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(copies, flat, group=parallel_context(trainer).dp_group)
        return torch.stack(copies)

    @classmethod
    def _agree(cls, trainer, pl_module) -> bool:
        copies = cls._replicas(trainer, pl_module)
        return torch.equal(copies[0], copies[1])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        copies = self._replicas(trainer, pl_module)
        self.agree.append(torch.equal(copies[0], copies[1]))
        self.replicas.append(copies)

    def on_train_end(self, trainer, pl_module):
        self.engine = trainer.strategy.data_parallel  # closed before on_fit_end; its counters stay readable
        residuals = [v for k, v in self.engine.state_dict().items() if k.startswith("residual.")]
        self.residual_nonzero = bool(residuals) and all(bool(r.abs().max() > 0) for r in residuals)

    def on_fit_end(self, trainer, pl_module):  # after the strategy's on_train_end, where DiLoCo's last sync runs
        final = self._agree(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(torch.stack(self.replicas), self.path + ".replicas.pt")  # [step, replica, parameters]
            stats = self.engine.stats
            with open(self.path, "w") as f:
                json.dump({
                    "agree": self.agree, "final": final, "collectives": stats.collectives, "bytes": stats.bytes_sent,
                    "residual_nonzero": self.residual_nonzero,
                }, f)


def _fit(strategy, module, steps, callbacks=(), ckpt_path=None, root=None, steps_per_epoch=None, devices=2):
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, precision=PRECISION, callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), default_root_dir=root,
    )
    trainer.fit(module, loader((steps_per_epoch or steps) * PER_RANK_BATCH * 2, PER_RANK_BATCH), ckpt_path=ckpt_path)
    return {k: v.detach() for k, v in module.state_dict().items()}


def _diloco(**kwargs):
    return HybridParallelStrategy(data_parallel_size=2, diloco=DiLoCo(**kwargs), start_method="forkserver")


@pytest.mark.parametrize(
    "tp, pp, ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 1, 2)], ids=["dp2", "dp2xtp2", "dp2xpp2", "dp2xtp2-ep2"]
)
def test_a_sync_every_step_with_plain_outer_sgd_is_data_parallel_training(tp, pp, ep):
    # Each replica steps theta - lr g_r; the average pseudo-gradient is lr * mean(g); the outer step with lr 1 and no
    # momentum lands on theta - lr * mean(g): the synchronous update. With tp or pp, per local shard; with ep, each
    # replica's experts are split over its tp peers, each expert shard averaged with the other replica's copy of it.
    steps = 4
    strategy = HybridParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
        expert_parallel_size=ep, diloco=DiLoCo(sync_every=1, outer_lr=1.0, outer_momentum=0.0),
        start_method="forkserver",
    )
    factory = (lambda: _tiny(SGDMini)) if ep == 1 else (lambda: _tiny(SGDMini, n_routed_experts=4))
    trained = _fit(strategy, factory(), steps, devices=2 * tp * pp)
    assert_state_close(trained, reference_training(factory, steps, PER_RANK_BATCH * 2), steps, lr=0.05)


def test_replicas_diverge_inside_a_round_agree_after_it_and_a_mid_round_resume_continues_exactly(tmp_path):
    # Epochs of 4 steps: the checkpoint at step 4 closes an epoch (a plain DataLoader restarts its epoch on a resume)
    # and falls inside a round (rounds end after steps 3 and 6).
    steps, epoch = 6, 4
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    straight = _fit(
        _diloco(sync_every=3), _tiny(), steps, [saves, ReplicasAgree(tmp_path / "a.json")], root=tmp_path, steps_per_epoch=epoch
    )
    record = json.loads((tmp_path / "a.json").read_text())
    assert record["agree"] == [False, False, True, False, False, True]  # rounds end after steps 3 and 6
    assert record["collectives"] == 2 and record["final"]  # nothing left to sync at the end

    step4 = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"  # mid-round: replicas differ, each saved its own state
    resumed = _fit(
        _diloco(sync_every=3), _tiny(), steps, [ReplicasAgree(tmp_path / "b.json")], ckpt_path=str(step4), root=tmp_path,
        steps_per_epoch=epoch,
    )
    assert_state_equal(resumed, straight)
    assert json.loads((tmp_path / "b.json").read_text())["agree"] == [False, True]


def test_int8_outer_gradients_in_two_fragments_keep_their_residuals_and_the_monitor_sees_them(tmp_path):
    steps = 4
    monitor = CommunicationMonitor(dirpath=str(tmp_path / "monitor"), gather_every=2, measure_link=False)
    trained = _fit(
        _diloco(sync_every=2, fragments=2, compression="int8"), _tiny(), steps, [ReplicasAgree(tmp_path / "r.json"), monitor]
    )
    record = json.loads((tmp_path / "r.json").read_text())
    # Fragment 0 ends its rounds after steps 2 and 4, fragment 1 (staggered by one step) after steps 1 and 3, and
    # once more at the end of fit (step 4's inner step), so every replica ends with the same model.
    assert record["collectives"] == 5 and not record["agree"][-1] and record["final"]
    numel = sum(p.numel() for p in _tiny().parameters())
    assert record["bytes"] < 0.3 * 5 / 2 * numel * 8  # int8 codes: about a quarter of float32, an eighth of float64
    assert record["residual_nonzero"]
    assert all(torch.isfinite(v).all() for v in trained.values())
    # The monitor: the outer syncs of the measured steps (after the first two) as stalls of the step, their bytes.
    profile = json.loads((tmp_path / "monitor" / "monitor.json").read_text())["profile"]
    assert profile["compression"] == "diloco-int8"
    assert all(rank["outer_sync"] > 0 and rank["dp_bytes"] > 0 for rank in profile["ranks"])


def test_an_overlapped_sync_lands_overlap_steps_later_and_a_resume_in_flight_continues_exactly(tmp_path):
    # Rounds of 2 steps, each sync overlapping 1 inner step: launched after steps 2, 4, 6, landed after 3, 5 and at
    # the end of fit. With a plain outer SGD step (lr 1, no momentum) the global values are the replicas' mean at the
    # launch; merge_alpha=0 makes every replica take them, dropping the overlapped step.
    steps, epoch = 6, 4
    straight_record = tmp_path / "a.json"
    config = dict(sync_every=2, overlap_steps=1, outer_lr=1.0, outer_momentum=0.0)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _fit(_diloco(**config, merge_alpha=0.0), _tiny(SGDMini), steps, [saves, ReplicasAgree(straight_record)], root=tmp_path,
         steps_per_epoch=epoch)
    record = json.loads(straight_record.read_text())
    replicas = torch.load(str(straight_record) + ".replicas.pt")
    assert record["agree"] == [False, False, True, False, True, False] and record["final"]
    assert record["collectives"] == 3
    for launch, land in ((1, 2), (3, 4)):  # 0-based step indices
        torch.testing.assert_close(replicas[land, 0], replicas[launch].mean(0), rtol=0, atol=1e-15)

    # merge_alpha=0.5 keeps half of the overlapped step: replicas differ after a landing, and end equal.
    kept = tmp_path / "b.json"
    _fit(_diloco(**config, merge_alpha=0.5), _tiny(SGDMini), steps, [ReplicasAgree(kept)], root=tmp_path, steps_per_epoch=epoch)
    record = json.loads(kept.read_text())
    assert not any(record["agree"]) and record["final"]

    # The checkpoint after step 4 holds the sync launched there, still to land: a resumed run lands it on time.
    resumed_record = tmp_path / "c.json"
    straight = torch.load(str(straight_record) + ".replicas.pt")
    _fit(_diloco(**config, merge_alpha=0.0), _tiny(SGDMini), steps, [ReplicasAgree(resumed_record)],
         ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"), root=tmp_path, steps_per_epoch=epoch)
    resumed = torch.load(str(resumed_record) + ".replicas.pt")
    assert torch.equal(resumed, straight[4:])


def test_diloco_arguments_fail_at_construction_with_what_would_work():
    with pytest.raises(ValueError, match=r"sync_every must be an integer >= 1 \(inner optimizer steps per round\), got 0"):
        DiLoCo(sync_every=0)
    with pytest.raises(ValueError, match="fragments=8 must not exceed sync_every=4"):
        DiLoCo(sync_every=4, fragments=8)
    with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\), got 1.0"):
        DiLoCo(outer_momentum=1.0)
    with pytest.raises(ValueError, match="compression='topk' is not one of 'none', 'fp16', 'bf16', 'int8', 'nf4'"):
        DiLoCo(compression="topk")
    with pytest.raises(ValueError, match=r"overlap_steps=4 must be below sync_every=4.*use overlap_steps <= 3"):
        DiLoCo(sync_every=4, overlap_steps=4)
    with pytest.raises(ValueError, match=r"merge_alpha must be in \[0, 1\).*got 1.0"):
        DiLoCo(overlap_steps=1, merge_alpha=1.0)
    with pytest.raises(ValueError, match=r"communication_compression='int8' compresses every step's gradient sync.* DiLoCo\(compression=...\)"):
        HybridParallelStrategy(communication_compression="int8", diloco=DiLoCo())
    with pytest.raises(ValueError, match="DiLoCo's workers are whole replicas"):
        HybridParallelStrategy(data_parallel_shard_size=2, diloco=DiLoCo())
    with pytest.raises(TypeError, match="diloco must be a lightning_ciuic.DiLoCo"):
        HybridParallelStrategy(diloco={"sync_every": 4})
