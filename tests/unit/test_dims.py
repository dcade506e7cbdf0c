import pytest

from lightning_ciuic import ParallelDims


def test_auto_data_parallel_takes_the_rest_of_the_world():
    dims = ParallelDims.resolve(8, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert (dims.pp, dims.dp, dims.tp) == (2, 2, 2)
    assert dims.pp_enabled and dims.dp_enabled and dims.tp_enabled
    assert str(dims) == "pp=2 x dp=2 x tp=2 (world size 8)"


def test_single_process_has_nothing_enabled():
    dims = ParallelDims.resolve(1)
    assert not (dims.pp_enabled or dims.dp_enabled or dims.tp_enabled)


def test_world_not_divisible_by_model_parallel_names_the_factors():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by .* = 1 \* 4 = 4; .* among \[1, 2, 3, 6\]"):
        ParallelDims.resolve(6, tensor_parallel_size=4)


def test_product_must_equal_world_size_and_says_what_works():
    with pytest.raises(ValueError, match=r"= 1 \* 4 \* 2 = 8, but the world size is 4; .*data_parallel_size=2 \(or 'auto'\)"):
        ParallelDims.resolve(4, data_parallel_size=4, tensor_parallel_size=2)


def test_product_mismatch_when_pp_tp_do_not_divide():
    with pytest.raises(ValueError, match=r"pp \* tp must also divide it \(one of \[1, 2, 4\]\)"):
        ParallelDims.resolve(4, data_parallel_size=1, tensor_parallel_size=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        ({"pipeline_parallel_size": 1.5}, "pipeline_parallel_size must be an integer >= 1, got 1.5"),
        ({"data_parallel_size": "many"}, "data_parallel_size must be an integer >= 1 or 'auto', got 'many'"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be an integer >= 1, got True"),
    ],
)
def test_bad_degrees(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(4, **kwargs)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        ParallelDims.resolve(0)


def test_auto_shard_size_follows_the_data_parallel_size():
    assert ParallelDims.resolve(4, data_parallel_shard_size="auto").dp_shard == 4  # plain FSDP over every dp rank
    assert ParallelDims.resolve(4, tensor_parallel_size=2, data_parallel_shard_size="auto").dp_shard == 2
    alone = ParallelDims.resolve(1, data_parallel_shard_size="auto")  # an elastic run down to one node
    assert alone.dp_shard == 1 and not alone.sharded
    with pytest.raises(ValueError, match="data_parallel_shard_size must be an integer >= 1 or 'auto', got 'all'"):
        ParallelDims.resolve(4, data_parallel_shard_size="all")


def test_with_diloco_the_experts_are_spread_over_each_replicas_tensor_parallel_peers():
    from lightning_ciuic import DiLoCo
    from lightning_ciuic.config import ParallelismConfig

    dims = ParallelismConfig(
        data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2, diloco=DiLoCo()
    ).resolve(4)
    assert dims.ep_in_replica and dims.ep_over_tp and dims.ep_data_ranks == 1 and dims.edp == 2
    assert "ep=2 (of the tensor-parallel peers)" in str(dims)
    without = ParallelismConfig(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2).resolve(4)
    assert not without.ep_over_tp and without.edp == 1  # the replicated layout borrows data-parallel ranks
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 with diloco: .* must equal tensor_parallel_size=1"):
        ParallelismConfig(data_parallel_size=2, expert_parallel_size=2, diloco=DiLoCo())
