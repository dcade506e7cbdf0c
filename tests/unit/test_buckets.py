import torch

from lightning_ciuic.comm.grad_sync import FIRST_BUCKET_BYTES, GradientSynchronizer


def _params(*numels):
    return [torch.nn.Parameter(torch.zeros(n)) for n in numels]


def test_buckets_follow_reverse_order_with_a_small_first_bucket():
    quarter_mb = FIRST_BUCKET_BYTES // 4 // 4  # float32 values in a quarter of the first bucket
    params = _params(*[quarter_mb] * 12)  # 3 MB in twelve 0.25 MB tensors
    sync = GradientSynchronizer(params, group=None, bucket_size_mb=1.5)
    sizes = [[p.numel() for p in b.params] for b in sync.buckets]
    assert sizes == [[quarter_mb] * 4, [quarter_mb] * 6, [quarter_mb] * 2]  # 1 MB, then 1.5 MB buckets
    assert sync.buckets[0].params[0] is params[-1]  # last registered first: backward order
    assert all(b.buffer.numel() == sum(p.numel() for p in b.params) for b in sync.buckets)
    sync.remove()


def test_a_tensor_larger_than_the_bucket_gets_its_own_and_frozen_ones_are_skipped():
    params = _params(10, 3_000_000, 10)
    params[0].requires_grad_(False)
    sync = GradientSynchronizer(params, group=None, bucket_size_mb=1.0)
    assert [[p.numel() for p in b.params] for b in sync.buckets] == [[10], [3_000_000]]
    sync.remove()
