"""parallelize() without a Trainer, on torch's fake process group: a 4-axis layout of 64 ranks (pp 2 x dp_replicate 2
x dp_shard 4 x tp 4) built on the meta device in one process, each rank's local shapes checked."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.pipeline_module import PipelineConfig, PipelineModule
from lightning_ciuic.parallel.parallelize import parallelize

LAYOUT = dict(pipeline_parallel_size=2, data_parallel_size=8, data_parallel_shard_size=4, tensor_parallel_size=4)
SHAPE = (2, 2, 4, 4)  # pp, dp_replicate, dp_shard, tp: the mesh's row-major order


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tiny(PipelineModule, nn.Module):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def pipeline_blocks(self):
        return ["embed", *(f"layers.{i}" for i in range(4)), "head"]

    def pipeline_loss(self, logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def tensor_parallel_plan(self, tp_mesh):
        return {name: style for i in range(4) for name, style in ((f"layers.{i}.up", ColwiseParallel()), (f"layers.{i}.down", RowwiseParallel()))}


def _local_shapes(rank: int) -> dict[str, tuple[int, ...]]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    try:
        config = ParallelismConfig(**LAYOUT, pipeline=PipelineConfig("1f1b", 2, split_points=("layers.2",)))
        with torch.device("meta"):
            module = Tiny()
        result = parallelize(module, config.resolve(64), config, materialize=False)
        assert result.pipeline is not None and result.fsdp is not None
        assert module.pipeline is result.pipeline  # handed to the module by the cut, read from nothing else
        return {name: tuple(p.to_local().shape) for name, p in module.named_parameters() if isinstance(p, DTensor)}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 21, 42, 63])
def test_every_rank_holds_its_stage_its_tensor_parallel_slice_and_its_data_parallel_shard(rank):
    stage, _, shard, tp = torch.unravel_index(torch.tensor(rank), SHAPE)
    shapes = _local_shapes(rank)
    # Stage 0: embed, layers 0-1; stage 1: layers 2-3, head. Colwise up (64 rows / tp 4 = 16) and rowwise down
    # (64 columns / tp 4 = 16) then FSDP's dim-0 shard over dp_shard 4; embed and head only the dim-0 shard.
    layers = (0, 1) if stage == 0 else (2, 3)
    expected = {f"layers.{i}.up.weight": (4, 32) for i in layers} | {f"layers.{i}.down.weight": (8, 16) for i in layers}
    expected |= {"embed.weight": (16, 32)} if stage == 0 else {"head.weight": (16, 32)}
    assert shapes == expected, (rank, int(stage), int(shard), int(tp))


class VocabularyParallel(Tiny):
    def tensor_parallel_plan(self, tp_mesh):
        return {**super().tensor_parallel_plan(tp_mesh), "embed": RowwiseParallel(input_layouts=Replicate())}


@pytest.mark.parametrize("meta", [False, True], ids=["built", "meta-built"])
def test_tensor_parallel_gradients_keep_their_parameters_placements_without_fsdp(meta):
    """DTensor computes a vocabulary-sharded embedding's gradient Replicate (the whole table on every tp rank); without
    FSDP2 nothing else redistributes it: every gradient, accumulated over two backwards, is its parameter's shard."""
    from lightning_ciuic.parallel.fsdp import materialize

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        config = ParallelismConfig(tensor_parallel_size=2, data_parallel_size=1)
        with torch.device("meta" if meta else "cpu"):
            module = VocabularyParallel()
        parallelize(module, config.resolve(2), config, materialize=False)
        if meta:
            materialize(module, torch.device("cpu"))  # to_empty swaps the parameters' contents, hooks included
        for _ in range(2):
            module(torch.randint(0, 64, (2, 8))).sum().backward()
        grads = {n: (p.grad.placements, p.grad.to_local().shape) for n, p in module.named_parameters() if isinstance(p, DTensor)}
        assert grads["embed.weight"] == ((Shard(0),), (32, 32))
        assert all(grads[n] == (p.placements, p.to_local().shape) for n, p in module.named_parameters() if n in grads)
    finally:
        dist.destroy_process_group()
