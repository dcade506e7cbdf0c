"""DiLoCo's fragments: contiguous, every parameter in exactly one, sizes about equal."""

import pytest

from lightning_ciuic.comm.diloco import split_fragments


@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 7])
def test_fragments_cover_every_parameter_exactly_once(fragments):
    sizes = [5, 100, 3, 40, 40, 40, 2, 90, 10, 30]
    groups = split_fragments(sizes, fragments)
    assert [i for g in groups for i in g] == list(range(len(sizes)))  # contiguous, in order, each once
    assert len(groups) == fragments
    if fragments == 4:  # 360 values: no fragment far from a quarter (a parameter is never split)
        assert max(sum(sizes[i] for i in g) for g in groups) <= 360 / 4 + 100


def test_more_fragments_than_parameters_leaves_none_empty():
    assert split_fragments([1, 1], 4) == [[0], [1]]
