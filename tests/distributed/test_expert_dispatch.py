"""The expert-parallel forward against the experts' own forward over 2 gloo ranks (float64): outputs, input and
routing-weight gradients equal; expert gradients equal the full-batch ones once averaged over the ep group; a rank
that receives no token, or routes none, still takes part; compressed dispatch stays within its codec's bound and
sends what its encoding says."""

import copy

import torch
import torch.distributed as dist

from examples.deepseek import PackedExperts
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.experts import shard_experts
from tests.helpers import run_workers

E, H, I, K = 4, 16, 8, 2


def _routing(tokens: int, rank: int, only: list[int] | None, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    choices = only if only is not None else list(range(E))
    index = torch.stack([torch.randperm(len(choices), generator=g)[:K] for _ in range(tokens)]) if tokens else torch.zeros(0, K, dtype=torch.long)
    index = torch.tensor(choices)[index] if tokens else index
    weights = torch.rand(tokens, K, generator=g, dtype=torch.float64)
    return x, index, weights


def _check(rank: int, world: int, tokens: int, only, dispatch: str, hidden: int = H) -> dict:
    torch.manual_seed(0)
    reference = PackedExperts(E, hidden, I).double()
    sharded = copy.deepcopy(reference)
    dims = ParallelDims.resolve(world, data_parallel_size=world, expert_parallel_size=world)
    layout = shard_experts(sharded, dims.build("cpu"), dispatch)
    x, index, weights = _routing(tokens, rank, only, hidden)
    x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
    x_ep, w_ep = x.clone().requires_grad_(), weights.clone().requires_grad_()
    expected, actual = reference(x_ref, index, w_ref), sharded(x_ep, index, w_ep)
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    expected.backward(upstream)
    actual.backward(upstream)
    for param in reference.parameters():  # the data-parallel mean of the full-batch gradients
        dist.all_reduce(param.grad)
        param.grad /= world
    return dict(
        layout=layout, expected=expected, actual=actual, x=(x_ref.grad, x_ep.grad), w=(w_ref.grad, w_ep.grad),
        params=[(p.grad.chunk(world)[rank], q.grad.to_local()) for p, q in zip(reference.parameters(), sharded.parameters())],
    )


def _exact(rank: int, world: int) -> None:
    for tokens, only in ((12, None), (12, [0, 1]), (0 if rank == 1 else 12, None)):  # random; all to rank 0; none from 1
        out = _check(rank, world, tokens, only, "none")
        torch.testing.assert_close(out["actual"], out["expected"], rtol=0, atol=1e-12)
        for expected, actual in (out["x"], out["w"], *out["params"]):
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
        if only == [0, 1]:
            assert out["layout"].stats.received_tokens == (2 * 12 * K if rank == 0 else 0)


def test_dispatch_and_combine_equal_the_experts_own_forward_with_empty_ranks():
    run_workers(_exact, 2)


def _compressed(rank: int, world: int) -> None:
    sent = {}
    for dispatch, bound in (("bf16", 2**-8), ("fp8", 2**-4), ("int8", 2**-7)):
        out = _check(rank, world, 64, None, dispatch, hidden=128)  # a row is one block of 128 (DeepSeek-V3's 1x128 tiles)
        # Relative to the largest value: a few of the codec's steps (the inputs' error through two small matmuls)
        for expected, actual in ((out["expected"], out["actual"]), out["w"], out["x"]):
            error = (actual - expected).abs().max() / expected.abs().max()
            assert error < 4 * bound, (dispatch, float(error))
        sent[dispatch] = out["layout"].stats.dispatch_bytes
    assert sent["fp8"] <= 0.55 * sent["bf16"] and sent["int8"] == sent["fp8"], sent


def test_compressed_dispatch_stays_within_the_codec_bound_and_sends_its_encoding():
    run_workers(_compressed, 2)
