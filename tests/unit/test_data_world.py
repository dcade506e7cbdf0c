"""Loaders pointed at the data-parallel world (lightning_ciuic/data/world.py) and the batch digest the equal-batch
check compares (lightning_ciuic/data/check.py), in one process."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_ciuic import compat
from lightning_ciuic.data.check import batch_digest
from lightning_ciuic.data.world import DataParallelWorld, data_parallel_world, point_loader, set_data_parallel_world

DP, GLOBAL = DataParallelWorld(rank=1, size=2), DataParallelWorld(rank=3, size=4)  # dp 2 x tp 2, global rank 3


def test_equal_batches_have_equal_digests_and_any_difference_changes_it():
    batch = {"tokens": torch.arange(12).view(3, 4), "mask": torch.ones(3, dtype=torch.bool), "names": ["a", "b"]}
    same = {"names": ["a", "b"], "mask": torch.ones(3, dtype=torch.bool), "tokens": torch.arange(12).view(3, 4)}
    assert batch_digest(batch) == batch_digest(same)  # mapping order does not matter
    changed = dict(batch, tokens=batch["tokens"].clone().index_put_((torch.tensor(2), torch.tensor(3)), torch.tensor(0)))
    others = [changed, dict(batch, tokens=batch["tokens"].view(4, 3)), dict(batch, tokens=batch["tokens"].double()),
              dict(batch, names=["a", "c"]), (batch["tokens"], batch["mask"])]
    assert len({batch_digest(b) for b in others} | {batch_digest(batch)}) == len(others) + 1
    assert batch_digest(torch.tensor(1.5, dtype=torch.bfloat16)) == batch_digest(torch.tensor(1.5, dtype=torch.bfloat16))


def test_a_users_distributed_sampler_over_the_global_world_splits_over_the_replicas():
    dataset = TensorDataset(torch.arange(10))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=4, rank=3, shuffle=True, seed=5))
    report = point_loader(loader, DP, GLOBAL)
    expected = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    assert report.kind == "sampler" and "now splits over the 2 data-parallel replicas" in report.notes[0]
    assert list(loader.sampler) == list(expected) and len(loader) == 3
    dropping = DistributedSampler(TensorDataset(torch.arange(11)), num_replicas=4, rank=3, drop_last=True)
    point_loader(DataLoader(dropping.dataset, sampler=dropping), DP, GLOBAL)
    assert len(dropping) == len(DistributedSampler(dropping.dataset, num_replicas=2, rank=1, drop_last=True)) == 5


def test_a_sampler_over_another_world_is_left_and_said():
    dataset = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(dataset, num_replicas=3, rank=0)
    report = point_loader(DataLoader(dataset, sampler=sampler), DP, GLOBAL)
    assert sampler.num_replicas == 3 and "left as it is" in report.notes[0]


class Hooked(IterableDataset):
    world = None

    def set_data_parallel(self, rank, size):
        self.world = (rank, size)

    def __iter__(self):
        rank, size = self.world
        return iter(range(rank, 8, size))


class Unreachable(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_iterable_datasets_get_the_hook_called_or_are_named_out_of_reach():
    hooked = Hooked()
    report = point_loader(DataLoader(hooked, batch_size=2), DP, GLOBAL)
    assert hooked.world == (1, 2) and report.kind == "hook" and "set_data_parallel(1, 2)" in report.notes[0]
    report = point_loader(DataLoader(Unreachable(), batch_size=2), DP, GLOBAL)
    assert report.kind == "iterable" and report.notes == []
    assert "Unreachable (an IterableDataset)" in report.description


def test_the_registered_world_is_what_datasets_read():
    assert data_parallel_world() == DataParallelWorld(0, 1)  # no process group, nothing registered
    set_data_parallel_world(DP)
    try:
        assert data_parallel_world() == DP
    finally:
        set_data_parallel_world(None)


def test_litdata_datasets_split_over_the_replicas_and_their_loader_resumes_in_that_world(tmp_path):
    litdata = pytest.importorskip("litdata", reason="litdata (test extra) is not installed")
    from tests.loaders import write_litdata

    write_litdata(tmp_path / "data")
    dataset = litdata.StreamingDataset(str(tmp_path / "data"))
    loader = litdata.StreamingDataLoader(dataset, batch_size=2)
    report = point_loader(loader, DP, GLOBAL)
    assert report.kind == "litdata" and "now over the 2 data-parallel replicas (this one 1)" in report.notes[0]
    env = dataset.distributed_env
    assert (env.world_size, env.global_rank) == (2, 1) and len(loader) == 8  # 32 samples, half of them, batches of 2
    assert [batch[:, 0].tolist() for batch in loader][0] == [16, 17]  # the second replica's first batch
    seen = []
    assert getattr(loader.load_state_dict, "_data_parallel_world", False)  # resumes in the replicas' world
    with compat.litdata_detects(env):
        seen.append(litdata.utilities.env._DistributedEnv.detect())
    assert seen == [env] and litdata.utilities.env._DistributedEnv.detect().world_size == 1  # restored after


def test_a_litdata_resume_on_another_number_of_replicas_says_what_it_repeats():
    from lightning_ciuic.data.world import _tell_restriping

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _tell_restriping({"dataset": {"world_size": 4, "sample_in_epoch": 24}}, DP, 4)  # 24 = 3 global batches of 2 x 4
        _tell_restriping({"dataset": {"world_size": 2, "sample_in_epoch": 20}}, DP, 4)  # the same replicas: exact
    with pytest.warns(UserWarning, match="saved over 4 data-parallel replicas on 2: it continues at sample 16 of the"
                      r" epoch \(a whole global batch of 2 x 4\), so the last 4 samples before the checkpoint are trained"):
        _tell_restriping({"dataset": {"world_size": 4, "sample_in_epoch": 20}}, DP, 4)


def test_a_litdata_state_saved_on_other_replicas_takes_the_datasets_drop_last():
    """LitData's default drop_last follows the world (True on several ranks, False on one) and its load_state_dict
    refuses a state whose drop_last differs: restored into another number of replicas, the dataset's own applies."""
    from types import SimpleNamespace

    from lightning_ciuic.data.world import _drop_last_of_this_world

    one = [SimpleNamespace(drop_last=False)]
    saved = {"dataset": {"world_size": 2, "drop_last": True, "sample_in_epoch": 8}, "num_samples_yielded": 4}
    assert _drop_last_of_this_world(saved, one, DataParallelWorld(0, 1))["dataset"]["drop_last"] is False
    assert saved["dataset"]["drop_last"] is True  # the checkpoint's dict is left as it was
    same = {"dataset": {"world_size": 1, "drop_last": True}}
    assert _drop_last_of_this_world(same, one, DataParallelWorld(0, 1)) is same  # the same world: LitData decides
    nested = {"dataset": {"0": {"world_size": 2, "drop_last": True}}}
    assert _drop_last_of_this_world(nested, one, DataParallelWorld(0, 1))["dataset"]["0"]["drop_last"] is False
