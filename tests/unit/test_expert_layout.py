"""Expert-parallel layouts: the errors a bad one gets before any process starts, and each rank's expert shards on
torch's fake process group (16 ranks in one process, the model on the meta device)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from examples.deepseek import DeepSeekTransformer, DeepSeekConfig
from lightning_ciuic import DiLoCo, HybridParallelStrategy
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.parallelize import parallelize
from lightning_ciuic.parallel.recompute import Recompute


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(data_parallel_size=4, expert_parallel_size=3), r"expert_parallel_size=3 must divide data_parallel_size=4 .* one of \[1, 2, 4\]"),
        (dict(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=3), r"or be tp=2 times a divisor of it.* one of \[1, 2, 4\]"),
        (dict(data_parallel_size=4, data_parallel_shard_size=2, expert_parallel_size=4), r"must divide data_parallel_shard_size=2 .* one of \[1, 2\]"),
        (dict(expert_parallel_size=0), r"expert_parallel_size"),
    ],
)
def test_a_degree_that_does_not_divide_the_data_parallel_axis_says_what_would(layout, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(4, **layout)


def test_ep_takes_the_tensor_parallel_peers_only_when_the_data_parallel_axis_alone_is_too_small():
    alone = ParallelDims.resolve(8, data_parallel_size=4, tensor_parallel_size=2, expert_parallel_size=4)
    assert not alone.ep_over_tp and alone.ep_data_ranks == 4 and alone.edp == 1
    over = ParallelDims.resolve(4, data_parallel_size=2, data_parallel_shard_size=2, tensor_parallel_size=2, expert_parallel_size=4)
    assert over.ep_over_tp and over.ep_data_ranks == 2 and over.edp == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(expert_dispatch_compression="fp4", expert_parallel_size=2), r"'fp4': use one of \['none', 'bf16', 'fp8', 'int8'\]"),
        (dict(expert_dispatch_compression="fp8"), r"expert_parallel_size=1 sends none"),
        (dict(expert_parallel_size=2, diloco=DiLoCo()), r"with diloco: .* must equal tensor_parallel_size=1"),
    ],
)
def test_bad_combinations_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def _expert_shapes(rank: int, world: int, n_experts: int, **layout) -> dict[str, tuple]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        config = ParallelismConfig(**layout)
        with torch.device("meta"):
            model = DeepSeekTransformer(DeepSeekConfig(dim=32, n_layers=2, n_heads=2, n_routed_experts=n_experts, moe_inter_dim=16))
        result = parallelize(model, config.resolve(world), config, materialize=False)
        assert result.experts is not None
        return {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if "experts" in name and isinstance(p, DTensor)}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 5, 15])
def test_each_rank_holds_its_experts_sharded_again_over_the_ranks_that_share_them(rank):
    # 16 ranks, FSDP 8 x HSDP replicas 2, ep 4: 8 experts -> 2 per ep rank, then FSDP2 over edp = 8 / 4 = 2 ranks.
    shapes = _expert_shapes(rank, 16, 8, data_parallel_size=16, data_parallel_shard_size=8, expert_parallel_size=4)
    assert shapes == {"layers.1.ffn.experts.gate_up_proj": (1, 32, 32), "layers.1.ffn.experts.down_proj": (1, 32, 16)}


def test_fewer_experts_per_rank_than_sharing_ranks_shard_on_the_next_dim():
    # 4 experts, ep 2 -> 2 per ep rank, FSDP2 over edp = 8 / 2 = 4 ranks: each keeps every row block of its 2 experts.
    shapes = _expert_shapes(3, 8, 4, data_parallel_size=8, data_parallel_shard_size=8, expert_parallel_size=2)
    assert shapes == {"layers.1.ffn.experts.gate_up_proj": (2, 8, 32), "layers.1.ffn.experts.down_proj": (2, 8, 16)}


def test_experts_that_the_ep_degree_does_not_divide_are_refused_with_the_divisors():
    with pytest.raises(ValueError, match=r"has 6 experts, which expert_parallel_size=4 does not divide: use one of \[1, 2, 3, 6\]"):
        _expert_shapes(0, 4, 6, data_parallel_size=4, expert_parallel_size=4)


def test_routed_tokens_are_counted_once_when_blocks_are_recomputed_in_backward():
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic.parallel.experts import RoutedTokens
    from lightning_ciuic.parallel.parallelize import checkpoint_blocks

    torch.manual_seed(0)
    model = DeepSeekMini(dim=32, n_layers=2, n_heads=2, kv_lora_rank=8, n_routed_experts=4, moe_inter_dim=16).train()
    checkpoint_blocks(model, Recompute.parse(True))  # every block's forward runs again inside backward
    routed = RoutedTokens(model)
    tokens = torch.randint(0, 256, (2, 8))
    model(tokens).sum().backward()
    (counts,) = routed.take().values()
    assert int(counts.sum()) == tokens.numel() * 2  # k = 2 experts per token, once
    model.eval()
    model(tokens)
    assert routed.take() == {}  # evaluation is not training's load
