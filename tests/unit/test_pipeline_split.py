"""Pipeline stage splitting without processes: balance, split points, placement, partition."""

import pytest
import torch
from torch import nn

from lightning_ciuic.parallel.pipeline import (
    OnAnotherStage,
    balanced_split,
    block_modules,
    partition,
    split_at,
    stage_ids_of_rank,
    theoretical_bubble,
)


def test_balanced_split_minimizes_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_split([32, 200, 200, 200, 200, 1, 32], 2) == [0, 3]  # 432 | 433
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balanced_split([3, 3, 3], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot cut 3 pipeline blocks into 4 stages: each stage needs at least one block"):
        balanced_split([1, 1, 1], 4)


def test_split_points():
    names = ["embed", "l0", "l1", "l2", "head"]
    assert split_at(names, ["l1"], 2) == [0, 2]
    with pytest.raises(ValueError, match="1 pipeline split points give 2 stages, but .* = 4 stages are needed; give 3"):
        split_at(names, ["l1"], 4)
    with pytest.raises(ValueError, match=r"pipeline split point 'l9' is not a pipeline block; blocks are \['embed'"):
        split_at(names, ["l9"], 2)
    with pytest.raises(ValueError, match="must name distinct blocks in order, after the first block"):
        split_at(names, ["l2", "l1"], 3)


def test_stage_placement_and_bubble():
    assert stage_ids_of_rank(1, 2, 1, "1f1b") == [1]
    assert stage_ids_of_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_ids_of_rank(0, 2, 2, "zbv_zero_bubble") == [0, 3]
    assert theoretical_bubble(2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble(4, 4) == pytest.approx(3 / 7)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10)


BLOCKS = ["embed", "layers.0", "layers.1", "layers.2", "head"]


def test_partition_keeps_parameter_names_and_explains_a_call_to_another_stage():
    net = Net()
    full = set(net.state_dict())
    (stage,) = partition(net, BLOCKS, [0, 2], [1])
    assert set(net.state_dict()) == {k for k in full if k.startswith(("layers.1", "layers.2", "head"))}
    assert isinstance(net.embed, OnAnotherStage)
    assert len(stage.blocks) == 3 and stage(torch.randn(2, 4)).shape == (2, 10)
    with pytest.raises(RuntimeError, match="'embed' runs on pipeline stage 0, not on this rank"):
        net.embed(torch.tensor([1]))


def test_block_protocol_errors():
    with pytest.raises(ValueError, match=r"pipeline blocks \['layers.7'\] are not sub-modules of Net"):
        block_modules(Net(), ["embed", "layers.7"])
    with pytest.raises(ValueError, match=r"parameters \['head.weight', 'head.bias'\] belong to no pipeline block"):
        block_modules(Net(), BLOCKS[:-1])
    tied = Net()
    tied.head.weight = tied.layers[0].weight
    with pytest.raises(ValueError, match="a parameter is shared by pipeline blocks 'layers.0' and 'head'"):
        block_modules(tied, BLOCKS)
    with pytest.raises(ValueError, match="pipeline blocks must be distinct"):
        block_modules(Net(), ["embed", "embed"])


def test_a_pipeline_module_runs_through_the_runner_attached_to_it_and_its_copies_hold_none():
    import copy

    from lightning_ciuic.parallel.pipeline_module import PipelineModule

    class Two(PipelineModule, nn.Module):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

        def forward(self, x):
            return self.b(self.a(x))

        def pipeline_blocks(self):
            return ["a", "b"]

        def pipeline_loss(self, outputs, targets):
            return (outputs - targets).pow(2).mean()

    class Runner:  # what the cut hands the module: its stages' schedule
        def forward(self, inputs):
            return "through the runner"

    module = Two()
    x = torch.ones(3, 2)
    assert module.pipeline is None and torch.equal(module.pipelined_forward(x), module(x))
    module.attach_pipeline(Runner())
    assert module.pipelined_forward(x) == "through the runner"
    assert copy.deepcopy(module).pipeline is None  # a copy is no rank's stages
