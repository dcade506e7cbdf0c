"""torchdata's StatefulDataLoader resumed in another data-parallel size (lightning_ciuic/data/stateful.py), in one
process: each replica's loader is built as the strategy points it, the state of replica 0 is what a checkpoint
keeps (Lightning's loop state is written by the first rank), and the samples of the epoch are counted over both runs."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest
from torch.utils.data import DistributedSampler, IterableDataset

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata (test extra) is not installed")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

from lightning_ciuic.data.stateful import DP_SIZE  # noqa: E402
from lightning_ciuic.data.world import DataParallelWorld, point_loader  # noqa: E402

N, BATCH = 48, 2


def _loaders(size: int, sampler: type = DistributedSampler, **kwargs) -> list[StatefulDataLoader]:
    """One loader per replica of ``size``, its sampler built over the replicas, pointed by the strategy's call."""
    loaders = []
    for rank in range(size):
        data = list(range(N))
        loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler(data, size, rank, seed=5), **kwargs)
        point_loader(loader, DataParallelWorld(rank, size), DataParallelWorld(rank, size))
        loaders.append(loader)
    return loaders


def _take(loader: StatefulDataLoader, steps: int | None = None) -> list[int]:
    return [int(i) for batch in islice(iter(loader), steps) for i in batch]


@pytest.mark.parametrize("sampler", [DistributedSampler, StatefulDistributedSampler])
@pytest.mark.parametrize("before, now, steps", [(4, 2, 3), (2, 4, 2), (2, 2, 3)])
def test_a_resume_into_another_data_parallel_size_sees_each_sample_once(sampler, before, now, steps):
    first = _loaders(before, sampler)
    seen = Counter(i for loader in first for i in _take(loader, steps))
    state = first[0].state_dict()
    assert state[DP_SIZE] == before
    for loader in _loaders(now, sampler):
        loader.load_state_dict(state)
        seen.update(_take(loader))
    assert seen == Counter(range(N))  # none skipped, none repeated


def test_the_conversion_is_what_makes_it_exact():
    """Without the size in the state (a checkpoint of torchdata's own), dp 4 -> 2 repeats samples: the failure fixed."""
    first = _loaders(4)
    seen = Counter(i for loader in first for i in _take(loader, 3))
    state = {k: v for k, v in first[0].state_dict().items() if k != DP_SIZE}
    for loader in _loaders(2):
        loader.load_state_dict(state)
        seen.update(_take(loader))
    assert max(seen.values()) == 2


def test_a_position_between_the_new_global_batches_is_refused_saying_what_works():
    first = _loaders(2)
    _take(first[0], 1)  # 2 replicas x 2 samples: half a global batch of 4 replicas
    with pytest.raises(ValueError) as raised:
        _loaders(4)[0].load_state_dict(first[0].state_dict())
    assert str(raised.value) == (
        "Cannot resume the StatefulDataLoader over list saved over 2 data-parallel replicas on 4 without skipping or"
        " repeating samples: 4 samples of the epoch were taken (2 x batches of 2), not a whole number of the 8 samples"
        " of a step on 4 replicas. What works: resume on 2 data-parallel replicas (any tensor or pipeline size), or"
        " from a checkpoint taken after a multiple of 8 samples of the epoch."
    )


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


def test_an_iterable_dataset_or_workers_are_refused_saying_why():
    def loader(dataset, **kwargs) -> StatefulDataLoader:
        built = StatefulDataLoader(dataset, batch_size=BATCH, **kwargs)
        point_loader(built, DataParallelWorld(0, 2), DataParallelWorld(0, 2))
        return built

    stream = loader(Stream())
    _take(stream, 1)
    state = stream.state_dict()
    with pytest.raises(ValueError, match="an IterableDataset's state is its own replica's share, which cannot be"):
        loader(Stream()).load_state_dict({**state, DP_SIZE: 4})
    loader(Stream()).load_state_dict(state)  # the same size: torchdata's own resume

    data = list(range(N))
    working = loader(data, sampler=DistributedSampler(data, 2, 0), num_workers=1)
    _take(working, 1)
    with pytest.raises(ValueError, match=r"counts the samples sent to the workers.*or train with num_workers=0"):
        loader(data, sampler=DistributedSampler(data, 2, 0), num_workers=1).load_state_dict(
            {**working.state_dict(), DP_SIZE: 4}
        )


def test_an_epoch_that_was_over_starts_the_next_on_any_size():
    (whole,) = _loaders(1)
    _take(whole)
    (after,) = _loaders(1)
    state = {**whole.state_dict(), DP_SIZE: 3}
    after.load_state_dict(state)
    assert sorted(_take(after)) == list(range(N))
