import pytest

from lightning_ciuic import ParallelDims
from lightning_ciuic.parallel.axes import Axis


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


# -- what a rank holds: coordinates and layout keys -------------------------------------------------------------
def _keys(dims):
    return [dims.layout_key(rank) for rank in range(dims.world_size)]


def test_expert_parallel_over_the_tp_peers_and_over_the_dp_ranks_of_equal_degrees_get_different_keys():
    """dp 2 x tp 2 x ep 2 both: under DiLoCo rank r's expert peers are its tp peers, without it its dp peers. Same
    degrees, other experts on other ranks: a per-rank state keyed by degrees alone would restore onto the wrong shard."""
    from lightning_ciuic import DiLoCo
    from lightning_ciuic.config import ParallelismConfig

    layout = dict(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2)
    plain = ParallelismConfig(**layout).resolve(4)
    diloco = ParallelismConfig(**layout, diloco=DiLoCo()).resolve(4)
    assert (plain.pp, plain.dp, plain.tp, plain.ep) == (diloco.pp, diloco.dp, diloco.tp, diloco.ep)
    assert [plain.coordinates(r)[Axis.EP] for r in range(4)] == [0, 0, 1, 1]  # ranks 0, 2 exchange tokens
    assert [diloco.coordinates(r)[Axis.EP] for r in range(4)] == [0, 1, 0, 1]  # ranks 0, 1 do
    assert all(p != d for p, d in zip(_keys(plain), _keys(diloco)))
    assert (plain.layout_key(1), diloco.layout_key(1)) == ("pp0of1.tp1of2.ep0of2-dp2", "pp0of1.tp1of2.ep1of2-dp1xtp2")
    assert len(set(_keys(plain))) == 4  # each rank its own experts and tp slice
    assert _keys(diloco)[:2] == _keys(diloco)[2:] != _keys(diloco)[:1] * 2  # each replica the same two shards


def test_ranks_that_hold_equal_state_share_a_key_and_no_other_does():
    replicated = ParallelDims.resolve(8, tensor_parallel_size=2)  # dp 4: replicas of each tp slice
    assert _keys(replicated) == ["pp0of1.tp0of2", "pp0of1.tp1of2"] * 4
    hsdp = ParallelDims.resolve(8, data_parallel_shard_size=2, tensor_parallel_size=2)  # dp_replicate 2 x dp_shard 2
    keys = _keys(hsdp)
    for rank in range(8):
        c = hsdp.coordinates(rank)
        same = {r for r in range(8) if keys[r] == keys[rank]}
        assert same == {r for r in range(8) if (hsdp.coordinates(r)[Axis.DP_SHARD], hsdp.coordinates(r)[Axis.TP]) == (c[Axis.DP_SHARD], c[Axis.TP])}
    piped = ParallelDims.resolve(4, pipeline_parallel_size=2)
    assert _keys(piped) == ["pp0of2.tp0of1", "pp0of2.tp0of1", "pp1of2.tp0of1", "pp1of2.tp0of1"]
    # An elastic change of the replicas keeps every key; of the shards' degree, none.
    assert set(_keys(ParallelDims.resolve(12, data_parallel_shard_size=2, tensor_parallel_size=2))) == set(keys)
    assert not set(_keys(ParallelDims.resolve(8, data_parallel_shard_size=4, tensor_parallel_size=2))) & set(keys)
    with pytest.raises(ValueError, match=r"global_rank=8 is outside the world of 8 ranks \(pp=1 x dp=4"):
        hsdp.layout_key(8)


LAYOUTS = [  # (world, degrees): the views build() makes, against the arithmetic of coordinates()
    (16, dict(pipeline_parallel_size=2, data_parallel_size=4, data_parallel_shard_size=2, tensor_parallel_size=2, expert_parallel_size=2)),
    (8, dict(data_parallel_size=2, tensor_parallel_size=4, expert_parallel_size=4, diloco=True)),
    (8, dict(data_parallel_size=4, tensor_parallel_size=2, expert_parallel_size=4)),  # ep = 2 dp ranks x tp
]


@pytest.mark.parametrize("world, degrees", LAYOUTS)
def test_every_view_is_built_once_and_agrees_with_the_coordinates(world, degrees):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_ciuic import DiLoCo
    from lightning_ciuic.config import ParallelismConfig

    config = ParallelismConfig(**{**degrees, "diloco": DiLoCo() if degrees.get("diloco") else None})
    dims = config.resolve(world)
    for rank in (0, world // 2 + 1, world - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            meshes = dims.build("cpu")
            coords = dims.coordinates(rank)
            for axes, mesh in meshes.views.items():
                if len(axes) == 1:
                    assert mesh.get_local_rank() == coords[axes[0]], (rank, axes)
            assert meshes.mesh(Axis.EP) is meshes.ep_mesh and meshes.ep_mesh.size() == dims.ep
            assert meshes.expert_data_mesh.size() == dims.edp * (dims.dp_replicate if dims.sharded else 1)
            assert meshes.data_parallel_mesh is (meshes.fsdp_mesh if dims.sharded else meshes.mesh(Axis.DP))
            assert meshes.world["data_parallel"].size() == dims.dp  # Lightning's names for the same axes
        finally:
            dist.destroy_process_group()


def test_a_view_the_layout_lacks_is_named_with_the_ones_it_has():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        meshes = ParallelDims.resolve(4, tensor_parallel_size=2).build("cpu")
        with pytest.raises(KeyError, match=r"no \(<Axis.EP: 'ep'>,\) view in the layout pp=1 x dp=2 x tp=2 .* it has \(dp\), \(pp\), \(tp\)"):
            meshes.mesh(Axis.EP)
    finally:
        dist.destroy_process_group()
