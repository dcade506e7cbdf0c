"""GradientSynchronizer on real gloo process groups (world sizes 2 and 4)."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ciuic.comm.grad_sync import GradientSynchronizer, GradientSyncTimeoutError
from tests.helpers import run_workers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + rank))


def _averaged_gradients_match_the_mean_of_every_rank(rank, world):
    for bucket_mb in (25.0, 0.0005):  # one bucket, and many (one process group start for both)
        _check_average(rank, world, bucket_mb)


def _check_average(rank, world, bucket_mb):
    model = _model()
    sync = GradientSynchronizer(model.parameters(), dist.group.WORLD, bucket_size_mb=bucket_mb, timeout=30)
    model(_batch(rank)).square().mean().backward()
    sync.finish()
    expected = _model()
    for r in range(world):
        (expected(_batch(r)).square().mean() / world).backward()
    for ours, ref in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(ours.grad, ref.grad)
    if bucket_mb < 0.001:
        assert len(sync.buckets) > 1, "a tiny bucket size must split the model into several buckets"
    assert sync.stats.collectives == len(sync.buckets)


@pytest.mark.parametrize("world", [2, 4])
def test_average_equals_the_mean_gradient(world):
    run_workers(_averaged_gradients_match_the_mean_of_every_rank, world)


def _no_sync_issues_no_collective(rank, world):
    model = _model()
    sync = GradientSynchronizer(model.parameters(), dist.group.WORLD, bucket_size_mb=0.0005, timeout=30)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for micro in range(3):  # accumulation: only the last micro-step synchronizes
            if micro < 2:
                with sync.no_sync():
                    model(_batch(rank + 10 * micro)).sum().backward()
            else:
                model(_batch(rank + 10 * micro)).sum().backward()
                sync.finish()
    finally:
        dist.all_reduce = real
    assert len(calls) == len(sync.buckets) > 1
    expected = _model()
    for micro in range(3):
        for r in range(world):
            (expected(_batch(r + 10 * micro)).sum() / world).backward()
    for ours, ref in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(ours.grad, ref.grad)


def test_accumulation_syncs_only_on_the_last_micro_step():
    run_workers(_no_sync_issues_no_collective, 2)


def _unused_parameter_still_gets_the_average(rank, world):
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    sync = GradientSynchronizer(model.parameters(), dist.group.WORLD, timeout=30)
    sync.broadcast_parameters(model.parameters())
    x = torch.ones(1, 3) * (rank + 1)
    out = model["a"](x) if rank == 0 else model["a"](x) + model["b"](x)  # "b" unused on rank 0
    out.sum().backward()
    sync.finish()
    assert model["b"].weight.grad is not None
    grads = [torch.zeros_like(model["b"].weight.grad) for _ in range(world)]
    dist.all_gather(grads, model["b"].weight.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], torch.full((3, 3), 2.0 / world))


def test_a_parameter_unused_on_one_rank_gets_the_same_average_everywhere():
    run_workers(_unused_parameter_still_gets_the_average, 2)


def _stalled_peer(rank, world, result_path):
    model = _model()
    sync = GradientSynchronizer(model.parameters(), dist.group.WORLD, timeout=1.0)
    if rank == 1:
        time.sleep(4)
    model(_batch(rank)).sum().backward()
    try:
        sync.finish()
    except GradientSyncTimeoutError as err:
        if rank == 0:
            result_path.write_text(str(err))
    except RuntimeError:
        pass  # the stalled rank's own collective fails once its peer has given up


def test_sync_timeout_fires_with_its_message(tmp_path):
    result = tmp_path / "error.txt"
    run_workers(_stalled_peer, 2, result)
    message = result.read_text()
    assert "over mesh axis 'dp' (ranks [0, 1]) did not finish within sync_timeout=1s" in message
    assert "bucket 0" in message and "raise `sync_timeout`" in message


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"bucket_size_mb must be > 0, got 0"):
        GradientSynchronizer([], None, bucket_size_mb=0)
    with pytest.raises(ValueError, match=r"sync_timeout must be > 0 seconds, got 0"):
        GradientSynchronizer([], None, timeout=0)
