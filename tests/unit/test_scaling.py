"""Scale decisions on synthetic throughput measurements: scale up, scale down, hold, and the node bounds."""

from __future__ import annotations

import pytest

from lightning_ciuic.parallel.scaling import NodeWindow, decide, predicted_step_seconds

G = 256  # global batch, samples


def _window(speeds: list[float], seconds: float = 10.0) -> list[NodeWindow]:
    return [NodeWindow(node=i, samples=int(v * seconds), compute_seconds=seconds) for i, v in enumerate(speeds)]


def _measured_step(speeds: list[float], sync: float) -> float:
    return predicted_step_seconds(speeds, G, sync, len(speeds))


def test_compute_bound_cluster_scales_up():
    speeds, sync = [100.0, 100.0], 0.05  # 1.28 s of compute per step, 0.05 s of communication
    decision = decide(_window(speeds), _measured_step(speeds, sync), sync, G, 0.15, min_nodes=2, max_nodes=8)
    assert decision.action == "scale_up" and decision.target_nodes == 3
    assert decision.predicted_gain == pytest.approx((1.28 + 0.05) / (256 / 3 / 100 + 0.05 * (2 / 3) / (1 / 2)) - 1)
    assert decision.efficiency == pytest.approx((G / 1.33) / 200)


def test_communication_bound_cluster_holds():
    speeds, sync = [1000.0] * 4, 0.5  # compute 0.064 s per step, communication 0.5 s: another node barely helps
    decision = decide(_window(speeds), _measured_step(speeds, sync), sync, G, 0.15, min_nodes=4, max_nodes=8)
    assert decision.action == "hold"
    assert "would add" in decision.reason


def test_straggler_node_is_proposed_for_removal():
    speeds, sync = [100.0, 100.0, 100.0, 20.0], 0.02  # node 3 is 5x slower: everyone waits for it
    decision = decide(_window(speeds), _measured_step(speeds, sync), sync, G, 0.15, min_nodes=2, max_nodes=8)
    assert decision.action == "scale_down" and decision.node == 3 and decision.target_nodes == 3
    assert decision.predicted_gain < 0  # the cluster is faster without it
    assert min(decision.marginal, key=decision.marginal.get) == 3


def test_bounds_are_respected():
    speeds, sync = [100.0, 100.0, 100.0, 20.0], 0.02
    held = decide(_window(speeds), _measured_step(speeds, sync), sync, G, 0.15, min_nodes=4, max_nodes=4)
    assert held.action == "hold" and held.reason == "at max_nodes=4"
    speeds = [100.0, 100.0]
    capped = decide(_window(speeds), _measured_step(speeds, 0.05), 0.05, G, 0.15, min_nodes=1, max_nodes=2)
    assert capped.action != "scale_up"


def test_prediction_is_anchored_to_the_measured_step_time():
    speeds, sync = [100.0, 100.0], 0.05
    slower = 2 * _measured_step(speeds, sync)  # e.g. data loading the model does not see: same relative gains
    a = decide(_window(speeds), _measured_step(speeds, sync), sync, G, 0.15, 2, 8)
    b = decide(_window(speeds), slower, sync, G, 0.15, 2, 8)
    assert a.predicted_gain == pytest.approx(b.predicted_gain)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes=3 > max_nodes=2; use min_nodes <= max_nodes"),
        ({"min_nodes": 0}, "min_nodes must be an integer >= 1, got 0"),
        ({"scaling_threshold": 0}, "scaling_threshold must be > 0"),
        ({"scaling_threshold": -0.1}, "scaling_threshold must be > 0"),
        ({"monitoring_interval": 0}, "monitoring_interval must be > 0 seconds"),
        ({"scaling_strategy": "greedy"}, "scaling_strategy='greedy' is not one of 'performance_aware'"),
        ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1 or None, got 0"),
    ],
)
def test_elastic_manager_refuses_bad_arguments(kwargs, message):
    from lightning_ciuic import ElasticResourceManager

    with pytest.raises(ValueError, match=message):
        ElasticResourceManager(**kwargs)


def test_elastic_manager_needs_snapshot_recovery():
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ciuic import ElasticResourceManager

    trainer = Trainer(max_steps=1, callbacks=[ElasticResourceManager(min_nodes=1)], logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="add SnapshotRecovery"):
        trainer.fit(BoringModel())


def _stub_trainer(per_rank: int, dp: int, accumulate: int = 1, lr: float = 0.1):
    from types import SimpleNamespace

    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return SimpleNamespace(
        train_dataloader=SimpleNamespace(batch_size=per_rank),
        strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=dp,  # every rank a replica, as DDP
        accumulate_grad_batches=accumulate, optimizers=[optimizer], lr_scheduler_configs=[],
    )


def test_global_batch_is_kept_through_accumulation_and_the_lr_follows_when_it_cannot_be():
    from lightning_ciuic import ElasticResourceManager

    manager = ElasticResourceManager(min_nodes=1)
    first = _stub_trainer(per_rank=4, dp=4)  # the first run fixes the global batch: 16
    manager._keep_global_batch(first)
    assert manager.global_batch_size == 16 and first.accumulate_grad_batches == 1
    fewer = _stub_trainer(per_rank=4, dp=2)  # a node left: two micro-batches per step
    manager._keep_global_batch(fewer)
    assert fewer.accumulate_grad_batches == 2 and fewer.optimizers[0].param_groups[0]["lr"] == 0.1
    odd = _stub_trainer(per_rank=4, dp=3)  # 16 / 12 is not whole: 1 micro-batch, global 12, lr x 12/16
    manager._keep_global_batch(odd)
    assert odd.accumulate_grad_batches == 1 and odd.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.075)
    back = _stub_trainer(per_rank=4, dp=4, lr=0.075)  # whole again: the scaling is undone
    manager._keep_global_batch(back)
    assert back.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1) and manager.lr_scale == 1.0


def test_decisions_go_beside_the_runs_logs_not_the_current_directory(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_ciuic import ElasticResourceManager

    manager = ElasticResourceManager()
    logged = Trainer(accelerator="cpu", devices=1, logger=CSVLogger(tmp_path / "logs", name="run"), default_root_dir=tmp_path / "root")
    assert manager.decisions_path(logged) == tmp_path / "logs" / "run" / "version_0" / "elastic_decisions.jsonl"
    unlogged = Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path / "root")
    assert manager.decisions_path(unlogged) == tmp_path / "root" / "elastic_decisions.jsonl"
