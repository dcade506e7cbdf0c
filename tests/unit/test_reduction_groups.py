"""The data-parallel engines take reduction groups (comm/reduction.py, comm/engines.py): one engine built from a
parallelized model, its counters added up over every group (an expert-parallel run's expert gradients included), the
sharded engine's units in parallelize()'s order, and one clear error where groups cannot go together. Torch's fake
process group (collectives return at once; the engines count the bytes a ring sends)."""

from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from examples.deepseek import DeepSeekMini
from lightning_ciuic.comm.compression import CompressionConfig
from lightning_ciuic.comm.data_parallel import Replicated
from lightning_ciuic.comm.diloco import DiLoCo, DiLoCoEngine
from lightning_ciuic.comm.engines import build_engine, reduction_groups
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.comm.reduction import ReductionGroup
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.parallelize import parallelize
from lightning_ciuic.planner.layout import fake_world
from lightning_ciuic.tensors import local_tensor
from tests.helpers import TINY_MODEL


def _moe(layout: dict, world: int = 4):
    config = ParallelismConfig(**layout)
    dims = config.resolve(world)
    torch.manual_seed(0)
    module = DeepSeekMini(**{**TINY_MODEL, "n_routed_experts": 4})
    return module, parallelize(module, dims.build("cpu"), config), config


def test_a_replicated_expert_parallel_engine_counts_the_experts_gradient_bytes():
    """ep=2 over dp=4: each expert is held by 2 ranks, whose gradients the engine averages beside the dense ones; its
    payload and bytes (what CommunicationMonitor and the report read) count both groups."""
    with fake_world(0, 4):
        module, parallelized, config = _moe(dict(data_parallel_size=4, expert_parallel_size=2))
        engine = build_engine(parallelized, config)
        assert isinstance(engine, Replicated) and list(engine.synchronizers) == ["dense", "experts"]
        experts = parallelized.experts
        assert experts.data_mesh.size() == 2
        expert_values = sum(local_tensor(p).numel() for p in experts.parameters())
        dense_values = sum(p.numel() for p in module.parameters() if p.requires_grad and id(p) not in experts.parameter_ids())
        assert expert_values > 0 and engine.payload()[0] == dense_values + expert_values
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        engine.after_backward(accumulated=True)
        # A ring all-reduce sends 2 (w - 1) / w of each float32 value: 6 bytes over dp=4, 4 over the 2 expert replicas.
        assert engine.stats.bytes_sent == 6 * dense_values + 4 * expert_values
        assert engine.stats.bytes_reduced == 4 * (dense_values + expert_values)
        assert engine.stats.collectives == sum(len(s.buckets) for s in engine.synchronizers.values()) == engine.payload()[1]
        assert engine.synchronizers["experts"].axis_name == "edp"
        engine.close()


def test_the_sharded_engine_drives_parallelizes_units_in_their_order():
    """Sharded, the experts are units of their own over the ranks holding them: the groups give the engine the same
    units in the same order as parallelize() made them (the order its per-unit residuals are saved in)."""
    with fake_world(1, 4):
        module, parallelized, config = _moe(dict(data_parallel_size=4, data_parallel_shard_size=4, expert_parallel_size=2))
        groups = reduction_groups(parallelized, config.compression)
        assert [g.name for g in groups] == ["dense", "experts"] and groups[1].mesh is not groups[0].mesh
        engine = build_engine(parallelized, config)
        layout = parallelized.fsdp
        assert [id(u) for u in engine.units] == [id(u) for u in layout.units]
        assert [id(u) for u in engine.roots] == [id(u) for u in layout.roots]
        engine.close()


def test_build_engine_reads_the_bucket_size_and_timeout_from_the_config():
    with fake_world(0, 2):
        module = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        config = ParallelismConfig(data_parallel_size=2, bucket_size_mb=0.01, sync_timeout=12.0)
        dims = config.resolve(2)
        engine = build_engine(parallelize(module, dims.build("cpu"), config), config)
        assert engine.synchronizer.timeout == timedelta(seconds=12)
        assert len(engine.synchronizer.buckets) == 4  # 64 x 64 float32 weights are 16 KiB, over 10 KiB buckets
        engine.close()


def test_the_config_refuses_a_bucket_size_or_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match=r"bucket_size_mb must be > 0, got 0"):
        ParallelismConfig(bucket_size_mb=0)
    with pytest.raises(ValueError, match=r"sync_timeout must be a positive number of seconds, got -1"):
        ParallelismConfig(sync_timeout=-1)


def test_the_replicated_engine_refuses_groups_that_ask_for_different_compression():
    with fake_world(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        groups = [
            ReductionGroup("dense", tuple(a.parameters()), mesh, CompressionConfig()),
            ReductionGroup("experts", tuple(b.parameters()), mesh, CompressionConfig("fp16")),
        ]
        with pytest.raises(ValueError, match=r"the groups \['dense', 'experts'\] ask for \['fp16', 'none'\]: give them one"):
            Replicated().setup(nn.ModuleList([a, b]), groups)


def test_diloco_refuses_groups_over_other_ranks():
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "edp"))
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        groups = [ReductionGroup("dense", tuple(a.parameters()), mesh["dp"]), ReductionGroup("experts", tuple(b.parameters()), mesh["edp"])]
        with pytest.raises(ValueError, match=r"ranks \[0, 2\] \('dense'\); the groups \{'experts': \[0, 1\]\} reduce over other ranks"):
            DiLoCoEngine(DiLoCo(sync_every=4)).setup(nn.ModuleList([a, b]), groups)


def test_sync_stats_add_field_by_field():
    total = SyncStats(1, 2, 3, 0.5, 1.0, 0.25, 0.25) + SyncStats(10, 20, 30, 1.5, 2.0, 0.75, 0.75)
    assert total == SyncStats(11, 22, 33, 2.0, 3.0, 1.0, 1.0)
