"""Compressed and hand-written all-reduces against the exact mean, on world sizes 2 and 4."""

import pytest
import torch
import torch.distributed as dist

from lightning_ciuic.comm.codecs import TopK, dense_codec
from lightning_ciuic.comm.collectives import (
    native_allreduce_,
    quantized_allreduce_,
    ring_allreduce_,
    topk_allreduce_,
    tree_allreduce_,
)
from lightning_ciuic.comm.powersgd import PowerSGD
from tests.helpers import run_workers

N = 3001  # not a multiple of any block or world size


def _data(rank):
    return torch.randn(N, generator=torch.Generator().manual_seed(rank))


def _exact(world):
    return sum(_data(r) for r in range(world)) / world


def _identical_everywhere(x):
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    for other in gathered:
        assert torch.equal(other, x), "ranks must end with bit-identical results"


def _check_all(rank, world):
    exact = _exact(world)
    cases = {
        "ring-none": (lambda x: ring_allreduce_(x, dist.group.WORLD, dense_codec("none")), 1e-6, 2 * (world - 1) * 4 * -(-N // world)),
        "tree-none": (lambda x: tree_allreduce_(x, dist.group.WORLD, dense_codec("none")), 1e-6, None),
        "ring-fp16": (lambda x: ring_allreduce_(x, dist.group.WORLD, dense_codec("fp16")), 5e-3, None),
        "tree-bf16": (lambda x: tree_allreduce_(x, dist.group.WORLD, dense_codec("bf16")), 5e-2, None),
        "native-fp16": (lambda x: native_allreduce_(x, dist.group.WORLD, torch.float16), 5e-3, 2 * (world - 1) * 2 * N // world),
        "int8": (lambda x: quantized_allreduce_(x, dist.group.WORLD, dense_codec("int8")), 0.05, None),
        "nf4": (lambda x: quantized_allreduce_(x, dist.group.WORLD, dense_codec("nf4")), 0.9, None),
    }
    for name, (reduce, tol, expected_bytes) in cases.items():
        x = _data(rank)
        transmitted, sent = reduce(x)
        err = (x - exact).abs().max().item()
        assert err <= tol, f"{name}: max error {err} > {tol}"
        assert transmitted.shape == x.shape
        _identical_everywhere(x)
        if expected_bytes is not None:
            assert sent == expected_bytes, (name, sent, expected_bytes)
    # exact sums for the uncompressed hand-written algorithms, quantized byte formula
    for codec_name, fraction in (("int8", 0.27), ("nf4", 0.15)):
        x = _data(rank)
        _, sent = quantized_allreduce_(x, dist.group.WORLD, dense_codec(codec_name))
        assert sent <= fraction * 2 * (world - 1) * 4 * N / world * 1.1 + 2 * (world - 1) * 4 * 64
    # top-k: the average of every rank's top-k entries, exactly
    topk = TopK(0.01)
    x = _data(rank)
    transmitted, sent = topk_allreduce_(x, dist.group.WORLD, topk)
    expected = sum(topk.roundtrip(_data(r)) for r in range(world)) / world
    torch.testing.assert_close(x, expected)
    assert sent == (world - 1) * 8 * topk.k(N)


def _powersgd(rank, world):
    torch.manual_seed(0)  # a shared low-rank matrix plus rank-specific noise, and a vector
    base = torch.randn(40, 3) @ torch.randn(3, 30)
    g = torch.Generator().manual_seed(rank)
    matrix = base + 0.01 * torch.randn(40, 30, generator=g)
    vector = torch.randn(7, generator=g)
    x = torch.cat([matrix.reshape(-1), vector])
    shapes = [torch.Size([40, 30]), torch.Size([7])]
    psgd = PowerSGD(rank=4)
    for _ in range(3):  # warm start converges onto the dominant subspace
        y = x.clone()
        sent = psgd.allreduce_("b", y, shapes, dist.group.WORLD)
    all_vectors = [torch.empty(7) for _ in range(world)]
    dist.all_gather(all_vectors, vector)
    mean_vector = sum(all_vectors) / world
    torch.testing.assert_close(y[-7:], mean_vector)
    assert (y[:-7].view(40, 30) - base).abs().max() < 0.05
    assert sent == 2 * (world - 1) * 4 * ((40 + 30) * 4 + 7) // world
    _identical_everywhere(y)


def _collectives_then_powersgd(rank, world):
    _check_all(rank, world)
    _powersgd(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_against_the_exact_mean_and_powersgd_recovers_a_low_rank_average(world):
    """Every collective, then PowerSGD, in one process group per world size (a group start costs seconds)."""
    run_workers(_collectives_then_powersgd, world)
