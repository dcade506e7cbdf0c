"""The sharded engine's gradient size (``Sharded.payload``, the monitor's bytes, the HSDP replica-traffic estimate):
each parameter counted once, in the FSDP2 unit that owns it, at the size its all-gather yields on this rank (the
tensor-parallel part, not the global tensor), on every rank of 4-rank layouts (torch's fake process group: no
collective runs). Uneven data-parallel shards on purpose: 66 hidden units over tp 2 are 33, then 17 + 16 over
dp_shard 2; the head's 5 rows 3 + 2."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_ciuic.comm.engines import reduction_groups
from lightning_ciuic.comm.sharded import Sharded, owned_numel
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.fsdp import ShardingConfig, found_sharding
from lightning_ciuic.parallel.parallelize import parallelize

HIDDEN, INNER, VOCAB, OUT = 32, 66, 64, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, INNER, bias=False), nn.Linear(INNER, HIDDEN, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, OUT)  # 5 rows over dp_shard 2: 3 + 2

    def tensor_parallel_plan(self, tp_mesh):
        return {f"layers.{i}.{name}": style for i in range(2) for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}


ROOT_NUMEL = VOCAB * HIDDEN + OUT * HIDDEN + OUT  # embed, head: never cut by tp


def _block_numel(tp: int) -> int:
    """up's rows and down's columns, this tp rank's part of them."""
    return 2 * INNER // tp * HIDDEN


@pytest.fixture
def fake_world(request):
    rank, world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield rank
    dist.destroy_process_group()


LAYOUTS = {
    "fsdp2xtp2": dict(data_parallel_size=2, data_parallel_shard_size=2, tensor_parallel_size=2),
    "hsdp2x2": dict(data_parallel_size=4, data_parallel_shard_size=2),
    "fsdp4": dict(data_parallel_size=4, data_parallel_shard_size=4),
}


@pytest.mark.parametrize("fake_world", [(r, 4) for r in range(4)], indirect=True, ids=lambda p: f"rank{p[0]}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_each_parameter_counts_once_in_its_unit_at_its_tensor_parallel_size(fake_world, layout):
    config = ParallelismConfig(**LAYOUTS[layout])
    dims = config.resolve(4)
    module = Net()
    result = parallelize(module, dims, config)
    block = _block_numel(dims.tp)
    engine = Sharded(ShardingConfig())
    engine.setup(module, reduction_groups(result, config.compression))
    assert engine.payload() == (2 * block + ROOT_NUMEL, 3)
    assert owned_numel(result.fsdp) == [block, block, ROOT_NUMEL]
    assert owned_numel(found_sharding(module)) == [block, block, ROOT_NUMEL]  # read back from the units alone
    # HSDP: FSDP2 all-reduces each rank's gradient shard (1/dp_shard of the above) over the 2 replicas in float32.
    replica = 2 * (2 * block + ROOT_NUMEL) / 2 * 4 * (2 - 1) / 2 if layout == "hsdp2x2" else 0
    assert engine._replica_traffic() == int(replica)


@pytest.mark.parametrize("fake_world", [(1, 2)], indirect=True, ids=["rank1"])
def test_a_users_nested_units_each_count_only_their_own_parameters(fake_world):
    """The user's ``fully_shard`` of each linear layer, then each block, then the model: the innermost unit owns."""
    module = Net()
    mesh = init_device_mesh("cpu", (2,))
    for layer in module.layers:
        fully_shard(layer.up, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    layout = found_sharding(module)
    up = INNER * HIDDEN
    expected = {id(m): n for layer in module.layers for m, n in ((layer, up), (layer.up, up))} | {id(module): ROOT_NUMEL}
    assert owned_numel(layout) == [expected[id(unit)] for unit in (*layout.units, *layout.roots)]
    assert sum(owned_numel(layout)) == sum(p.numel() for p in module.parameters())
