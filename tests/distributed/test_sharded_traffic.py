"""The sharded engine's counted bytes match what its collectives move, on real gloo ranks: one forward all-gathers
every unit's parameters once, the backward gathers the resharded units again and reduce-scatters every gradient,
all counted by the FSDP2 collectives themselves (fsdp_comms); the engine's gradient size (``payload``, the
``bytes_reduced`` it adds) is the parameters' tensor-parallel size, each counted once; its HSDP estimate is 2 (r-1)/r
of the gradient shard FSDP2 all-reduces over the replicas."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_ciuic.comm.engines import reduction_groups
from lightning_ciuic.comm.sharded import Sharded
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.fsdp import ShardingConfig
from lightning_ciuic.parallel.parallelize import parallelize
from tests.helpers import run_workers
from tests.unit.test_parallelize import Block

FLOAT32 = 4

class Net(nn.Module):
    """Every dimension even over 2 ranks, so FSDP2 pads nothing and bytes follow from parameter counts alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def tensor_parallel_plan(self, tp_mesh):
        return {f"layers.{i}.{name}": style for i in range(2) for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}


def _tp_parts(param: torch.Tensor) -> int:
    """Into how many parts the tp axis cuts ``param`` (1 without tensor parallelism)."""
    mesh = param.device_mesh if isinstance(param, DTensor) else None
    if mesh is None or "tp" not in mesh.mesh_dim_names:
        return 1
    axis = mesh.mesh_dim_names.index("tp")
    return 1 if param.placements[axis].is_replicate() else mesh.size(axis)


def _step_bytes(rank: int, world: int, layout: dict) -> None:
    config = ParallelismConfig(**layout)
    dims = config.resolve(world)
    torch.manual_seed(0)
    module = Net()
    result = parallelize(module, dims, config)
    engine = Sharded(ShardingConfig())
    engine.setup(module, reduction_groups(result, config.compression))
    params = list(module.parameters())
    tp_local = sum(p.numel() // _tp_parts(p) for p in params)
    in_units = sum(p.numel() // _tp_parts(p) for unit in engine.units for p in unit.parameters())
    assert engine.payload() == (tp_local, 3)

    shard, replicas = dims.dp_shard, dims.dp // dims.dp_shard
    ring = (shard - 1) / shard * FLOAT32  # bytes sent per gathered or scattered value
    stats = engine.stats
    logits = module(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank // dims.tp)))
    assert stats.bytes_sent == ring * tp_local  # each unit gathered once
    sent, reduced = stats.bytes_sent, stats.bytes_reduced
    logits.float().pow(2).mean().backward()
    engine.after_backward()
    gradient_shard = sum(p.grad.to_local().numel() for p in params)
    assert gradient_shard * shard == tp_local  # nothing padded: the shards add up to the tensor-parallel size
    replica = 2 * (replicas - 1) / replicas * gradient_shard * FLOAT32  # FSDP2's all-reduce over dp_replicate
    # The blocks gathered again (resharded after forward; the root is not), every gradient reduce-scattered.
    assert stats.bytes_sent - sent == ring * in_units + ring * tp_local + int(replica)
    assert stats.bytes_reduced - reduced == FLOAT32 * tp_local


@pytest.mark.parametrize(
    "world, layout",
    [
        (4, dict(data_parallel_size=2, data_parallel_shard_size=2, tensor_parallel_size=2)),
        (4, dict(data_parallel_size=4, data_parallel_shard_size=2)),
        (2, dict(data_parallel_size=2, data_parallel_shard_size=2)),
    ],
    ids=["fsdp2xtp2", "hsdp2x2", "fsdp2"],
)
def test_counted_bytes_match_what_the_collectives_move(world, layout):
    run_workers(_step_bytes, world, layout)
