"""Which modules FSDP2 shards as units: the blocks of the outermost layer lists by default, or what fsdp_units names."""

import pytest
from torch import nn

from lightning_ciuic.parallel.fsdp import select_units


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([nn.Linear(2, 2)])  # nested list: not a unit of its own by default


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.body = nn.Sequential(nn.ModuleList([Block(), Block()]))
        self.head = nn.Linear(2, 4)


def test_default_units_are_the_blocks_of_the_outermost_lists():
    net = Net()
    assert select_units(net, None) == list(net.body[0])


def test_units_by_name_and_by_class_outermost_only():
    net = Net()
    assert select_units(net, ["head", "embed"]) == [net.head, net.embed]
    assert select_units(net, [Block, nn.Linear]) == [*net.body[0], net.head]  # Linears inside a Block are inside a unit


def test_unknown_units_name_what_exists():
    with pytest.raises(ValueError, match=r"fsdp_units names 'heads', which is not a sub-module of Net; names look like \['embed'"):
        select_units(Net(), ["heads"])
    with pytest.raises(ValueError, match="fsdp_units names the class Conv1d, but Net has no such sub-module"):
        select_units(Net(), [nn.Conv1d])


def test_the_sharded_engine_state_is_its_reduce_scatter_residuals():
    import torch

    from lightning_ciuic.wire.codecs import BlockInt8
    from lightning_ciuic.comm.fsdp_comms import ReduceScatterComm
    from lightning_ciuic.wire.timing import DeviceClock
    from lightning_ciuic.comm.sharded import Sharded
    from lightning_ciuic.parallel.fsdp import ShardingConfig

    def engine() -> Sharded:
        sharded = Sharded(ShardingConfig(gradient_codec="int8"))
        sharded.gradient_comms = [ReduceScatterComm(sharded.stats, DeviceClock(torch.device("cpu")), BlockInt8()) for _ in range(2)]
        return sharded

    saved = engine()
    saved.gradient_comms[1].residual = torch.arange(3.0)
    state = saved.state_dict()
    assert list(state) == ["reduce_scatter.1"]
    restored = engine()
    restored.load_state_dict(state)
    assert restored.gradient_comms[0].residual is None and torch.equal(restored.gradient_comms[1].residual, torch.arange(3.0))


def test_the_sharded_engine_says_what_it_compresses_and_whether_it_has_per_rank_state():
    import torch

    from lightning_ciuic.comm.sharded import Sharded
    from lightning_ciuic.parallel.fsdp import ShardingConfig

    assert (Sharded().label, Sharded().has_rank_state) == ("none", False)
    assert Sharded(ShardingConfig(reduce_dtype=torch.float16)).label == "fp16"
    int8 = Sharded(ShardingConfig(gradient_codec="int8", weight_codec="int8"))
    assert (int8.label, int8.has_rank_state) == ("int8 + int8 weights", True)
    assert not Sharded(ShardingConfig(gradient_codec="int8", error_feedback=False)).has_rank_state
