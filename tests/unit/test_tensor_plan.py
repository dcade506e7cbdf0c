import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_ciuic.parallel.tensor import validate_tensor_parallel_plan


def _mlp():
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))


def test_even_plan_is_accepted():
    validate_tensor_parallel_plan(_mlp(), 2, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    validate_tensor_parallel_plan(_mlp(), 3, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def test_tp_size_that_does_not_divide_a_layer_names_it_and_the_valid_sizes():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide 0.out_features=6 \(ColwiseParallel\).*\[1, 2, 3, 6\]"):
        validate_tensor_parallel_plan(_mlp(), 4, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with pytest.raises(ValueError, match=r"2.in_features=6 \(RowwiseParallel\)"):
        validate_tensor_parallel_plan(_mlp(), 4, {"2": RowwiseParallel()})


def test_plan_entry_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"plan entry 'layers.0.wq' matches no sub-module of Sequential"):
        validate_tensor_parallel_plan(_mlp(), 2, {"layers.0.wq": ColwiseParallel()})


def test_wildcards_are_checked_on_every_match():
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 3)})
    with pytest.raises(ValueError, match=r"b.out_features=3"):
        validate_tensor_parallel_plan(model, 2, {"*": ColwiseParallel()})
