"""DiLoCo's fragments: contiguous runs of equal length over the parameters laid end to end, every element in exactly
one, whatever the sizes of the tensors."""

import pytest
import torch

from lightning_ciuic.comm.diloco import Piece, split_fragments

SIZES = [5, 100, 3, 40, 40, 40, 2, 90, 10, 30]


@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 7])
def test_fragments_cover_every_element_exactly_once_in_equal_runs(fragments):
    runs = split_fragments(SIZES, fragments)
    covered = [(piece.param, piece.start + offset) for run in runs for piece in run for offset in range(piece.length)]
    assert covered == [(i, e) for i, size in enumerate(SIZES) for e in range(size)]  # in order, each element once
    lengths = [sum(piece.length for piece in run) for run in runs]
    assert len(runs) == fragments and max(lengths) - min(lengths) <= 1 and sum(lengths) == sum(SIZES)


def test_one_tensor_much_larger_than_the_rest_is_split_across_fragments():
    """The 8M-parameter MLP's case: one matrix is 83% of the model. Its fragments are still quarters."""
    runs = split_fragments([1000, 8300, 700], 4)
    assert [sum(p.length for p in run) for run in runs] == [2500, 2500, 2500, 2500]
    assert runs[0] == [Piece(0, 0, 1000), Piece(1, 0, 1500)] and runs[3] == [Piece(1, 6500, 1800), Piece(2, 0, 700)]


def test_more_fragments_than_elements_leaves_none_empty():
    assert split_fragments([1, 1], 4) == [[Piece(0, 0, 1)], [Piece(1, 0, 1)]]


def test_a_piece_is_a_view_that_writes_through():
    tensor = torch.zeros(3, 4)
    Piece(0, 2, 5).of(tensor).fill_(1.0)
    assert tensor.reshape(-1).tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
