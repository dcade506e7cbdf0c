"""Compressed and hand-written all-reduces against the exact mean, on world sizes 2 and 4."""

import pytest
import torch
import torch.distributed as dist

from datetime import timedelta

from lightning_ciuic.comm import collectives
from lightning_ciuic.wire.codecs import TopK, dense_codec
from lightning_ciuic.comm.compression import GradientCompression
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


def _quantized_is_exactly_two_roundings(rank, world):
    """The fused int8 and nf4 paths equal, bit for bit, their definition computed here from every rank's data: each rank's
    chunk j encoded once and decoded, summed in rank order in float32, divided, encoded once, decoded. Also for a
    tensor so short that the last ranks' chunks are empty, without the transmitted copy, and pipelined in parts
    (blocks start at the same offsets, so parts change nothing)."""
    for codec, numel in ((dense_codec(name), numel) for name in ("int8", "nf4") for numel in (N, 10)):
        data = [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
        chunk = -(-numel // (world * codec.block)) * codec.block
        padded = [torch.cat([d, torch.zeros(chunk * world - numel)]).view(world, chunk) for d in data]
        expected = []
        for j in range(world):
            summed = codec.roundtrip(padded[0][j])
            for r in range(1, world):
                summed = summed + codec.roundtrip(padded[r][j])
            expected.append(codec.roundtrip(summed / world))
        expected = torch.cat(expected)[:numel]
        for want_transmitted, part_values in ((True, None), (False, None), (True, 1024), (False, 1024)):
            if part_values:  # pipelined in parts of 1024 values: 3 parts of N, with their own padding
                monkeypatch = pytest.MonkeyPatch()
                monkeypatch.setattr(collectives, "PIPELINE_VALUES", part_values)
            x = data[rank].clone()
            transmitted, _ = quantized_allreduce_(x, dist.group.WORLD, codec, transmitted=want_transmitted)
            if part_values:
                monkeypatch.undo()
            assert torch.equal(x, expected), (numel, want_transmitted, part_values)
            if want_transmitted:
                assert torch.equal(transmitted, codec.roundtrip(data[rank]))
            else:
                assert transmitted is None


def _reducer_error_feedback(rank, world):
    """fp16 by default: the backend's async all-reduce of the cast bucket, no residual kept; fp16 with
    error_feedback=True and int8 by default: the residual is exactly what this rank's encoding dropped."""
    group = dist.group.WORLD
    g = _data(rank)
    reducer = GradientCompression("fp16")
    x = g.clone()
    pending = reducer("b", x, [x.shape], group)
    assert type(pending).__name__ == "_CastReduction", "fp16 without error feedback takes the backend's async path"
    pending.wait(timedelta(seconds=60))
    # w casts and w - 1 fp16 additions, each rounding by <= 2^-11 of a magnitude <= sum_r |g_r| / w, plus
    # fp16's subnormal spacing 2^-24 per rounding
    magnitude = sum(_data(r).abs() for r in range(world)) / world
    bound = (2 * world - 1) * (2 ** -11 * magnitude + 2 ** -24)
    assert ((x - _exact(world)).abs() <= bound).all()
    assert not reducer.error_feedback.residuals
    for mode, feedback, dropped in (("fp16", True, lambda v: v - v.half().float()), ("int8", None, None)):
        reducer = GradientCompression(mode, error_feedback=feedback)
        x = g.clone()
        reducer("b", x, [x.shape], group).wait(timedelta(seconds=60))
        if dropped is None:
            codec = dense_codec("int8")
            chunk = -(-N // (world * codec.block)) * codec.block
            own = codec.roundtrip(torch.cat([g, torch.zeros(chunk * world - N)]))[:N]
            dropped = lambda v: v - own  # noqa: E731
        assert torch.equal(reducer.error_feedback.residuals["b"], dropped(g)), mode
        reducer.close()


def _collectives_then_powersgd(rank, world):
    _check_all(rank, world)
    _quantized_is_exactly_two_roundings(rank, world)
    _reducer_error_feedback(rank, world)
    _powersgd(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_against_the_exact_mean_and_powersgd_recovers_a_low_rank_average(world):
    """Every collective, then PowerSGD, in one process group per world size (a group start costs seconds)."""
    run_workers(_collectives_then_powersgd, world)
