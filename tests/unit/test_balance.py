"""Uneven shares of the global batch: split arithmetic, the rebalancing rule, and exact epoch coverage."""


import pytest
import torch

from lightning_ciuic import DynamicDataBalancer
from lightning_ciuic.data.balance import BalancedBatchSampler, imbalance, proportional_split, rebalanced_split


def test_proportional_split_sums_and_floors():
    assert proportional_split(16, [2.0, 1.0]) == [11, 5]
    assert proportional_split(16, [1.0, 1.0, 1.0, 1.0]) == [4, 4, 4, 4]
    assert proportional_split(16, [100.0, 1.0], min_samples=3) == [13, 3]
    for weights in ([0.3, 0.7, 1.9], [5.0, 5.0, 1e-3], [1.0] * 7):
        shares = proportional_split(23, weights)
        assert sum(shares) == 23 and min(shares) >= 1


def test_proportional_split_rejects_impossible_requests():
    with pytest.raises(ValueError, match="at least 3 of 5 samples"):
        proportional_split(5, [1.0, 1.0], min_samples=3)
    with pytest.raises(ValueError, match="positive and finite"):
        proportional_split(5, [1.0, 0.0])


def test_rebalance_rule_threshold_target_and_bounded_shift():
    assert imbalance([1.0, 1.0]) == 0.0
    assert imbalance([1.0, 2.0]) == pytest.approx(1 / 1.5)
    # Below the threshold nothing moves; above it the split follows speed.
    assert rebalanced_split([8, 8], [1.0, 0.95], [1.0, 1.05], threshold=0.15) is None
    assert rebalanced_split([8, 8], [2.0, 1.0], [1.0, 2.0], threshold=0.15) == [11, 5]
    # gradient_aware's bound: no share moves by more than max_shift of itself in one rebalance.
    bounded = rebalanced_split([8, 8], [10.0, 1.0], [1.0, 10.0], threshold=0.15, max_shift=0.25)
    assert bounded == [10, 6]
    # Already at the target: no change reported.
    assert rebalanced_split([11, 5], [2.0, 1.0], [1.0, 2.0], threshold=0.15) is None


def _epoch(samplers, epoch):
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


@pytest.mark.parametrize("n, drop_last", [(64, False), (70, False), (70, True), (65, False)])
def test_every_sample_once_per_epoch_while_the_split_changes(n, drop_last):
    dp, batch = 2, 16
    samplers = [BalancedBatchSampler(n, batch, r, dp, seed=3, drop_last=drop_last) for r in range(dp)]
    iterators = [iter(s) for s in samplers]
    seen = []
    for step in range(len(samplers[0])):
        if step == 2:
            for s in samplers:
                s.split = [12, 4]
        for it in iterators:
            seen.extend(next(it, []))
    expected = n - n % batch if drop_last or n % batch < dp else n
    assert sorted(seen) == sorted(torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()[:expected])
    assert len(set(seen)) == len(seen)


def test_global_batches_equal_distributed_sampler_windows():
    """With any split, global batch i is the same sample set as DistributedSampler's i-th global batch."""
    n, dp, batch = 48, 2, 8
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5 + 1)).tolist()
    samplers = [BalancedBatchSampler(n, batch, r, dp, seed=5, split=[6, 2]) for r in range(dp)]
    per_rank = _epoch(samplers, epoch=1)
    for i in range(n // batch):
        assert sorted(per_rank[0][i] + per_rank[1][i]) == sorted(order[i * batch : (i + 1) * batch])
        assert (len(per_rank[0][i]), len(per_rank[1][i])) == (6, 2)


def test_resume_skips_the_batches_already_trained_once():
    sampler = BalancedBatchSampler(40, 8, 0, 2, seed=1)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.resume(epoch=2, batches_done=3)
    assert list(sampler) == full[3:]
    assert list(sampler) == full  # once only
    sampler.resume(epoch=1, batches_done=3)  # another epoch: ignored
    assert list(sampler) == full


def test_short_tail_split_in_proportion_and_tiny_tail_dropped():
    sampler_counts = [[len(b) for b in BalancedBatchSampler(21, 8, r, 2, split=[6, 2])] for r in range(2)]
    assert sampler_counts == [[6, 6, 4], [2, 2, 1]]
    assert [len(b) for b in BalancedBatchSampler(17, 8, 0, 2)] == [4, 4]  # one sample left for two ranks


def test_bad_splits_are_refused():
    sampler = BalancedBatchSampler(40, 8, 0, 2)
    with pytest.raises(ValueError, match="at least one sample and sum to the global batch size 8"):
        sampler.split = [8, 0]
    with pytest.raises(ValueError, match="cannot give each of 4 ranks"):
        BalancedBatchSampler(40, 3, 0, 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(monitoring_freq=0), "monitoring_freq must be an integer >= 1"),
        (dict(imbalance_threshold=0), "imbalance_threshold must be > 0"),
        (dict(imbalance_threshold=-0.1), "got -0.1"),
        (dict(rebalance_strategy="fastest"), "'fastest' is unknown; use 'throughput' or 'gradient_aware'"),
        (dict(min_share=0), "min_share must be in \\(0, 1\\]"),
        (dict(min_share=1.5), "got 1.5"),
    ],
)
def test_bad_arguments_name_what_would_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicDataBalancer(**kwargs)


def test_gradient_aware_distrusts_windows_with_unstable_gradient_norms():
    from lightning_ciuic.callbacks.data_balance import _unstable

    assert not _unstable([1.0, 2.0, 1.5]) and not _unstable([])
    assert _unstable([1.0, 1.1, 25.0]) and _unstable([1.0, float("nan")])
