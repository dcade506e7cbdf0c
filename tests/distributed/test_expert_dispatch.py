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
from lightning_ciuic.parallel.fp8 import fp8_linear
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


def _check(rank: int, world: int, tokens: int, only, dispatch: str, hidden: int = H, overlap: bool = False) -> dict:
    torch.manual_seed(0)
    reference = PackedExperts(E, hidden, I).double()
    sharded = copy.deepcopy(reference)
    dims = ParallelDims.resolve(world, data_parallel_size=world, expert_parallel_size=world)
    layout = shard_experts(sharded, dims.build("cpu"), dispatch, overlap=overlap)
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
    # random; all to rank 0; none from rank 1; overlapped, rank 1's one token leaves its second chunk empty
    cases = ((12, None, False), (12, [0, 1], False), (0 if rank == 1 else 12, None, False), (12, None, True),
             (12, [0, 1], True), (1 if rank == 1 else 12, [0, 1], True), (0 if rank == 1 else 12, None, True))
    for tokens, only, overlap in cases:
        out = _check(rank, world, tokens, only, "none", overlap=overlap)
        torch.testing.assert_close(out["actual"], out["expected"], rtol=0, atol=1e-12)
        for expected, actual in (out["x"], out["w"], *out["params"]):
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
        if only == [0, 1]:
            routed = torch.tensor(tokens)
            dist.all_reduce(routed)
            assert out["layout"].stats.received_tokens == (int(routed) * K if rank == 0 else 0)
        stats = out["layout"].stats
        # blocked no longer than the exchanges took (overlapped, they may all have arrived before their waits)
        assert 0 < stats.seconds and 0 <= stats.exposed_seconds <= stats.seconds, (overlap, stats)
        assert overlap or stats.exposed_seconds == stats.seconds, stats


def test_dispatch_and_combine_equal_the_experts_own_forward_with_empty_ranks():
    """Also overlapped (two chunks, one's all-to-alls in flight while the other computes), with a chunk empty."""
    run_workers(_exact, 2)


def _compressed(rank: int, world: int) -> None:
    sent = {}
    for dispatch, bound in (("bf16", 2**-8), ("fp8", 2**-4), ("int8", 2**-7)):
        for overlap in (False, True):
            out = _check(rank, world, 64, None, dispatch, hidden=128, overlap=overlap)  # a row is one block of 128 (DeepSeek-V3's 1x128 tiles)
            # Relative to the largest value: a few of the codec's steps (the inputs' error through two small matmuls)
            for expected, actual in ((out["expected"], out["actual"]), out["w"], out["x"]):
                error = (actual - expected).abs().max() / expected.abs().max()
                assert error < 4 * bound, (dispatch, overlap, float(error))
            sent[dispatch, overlap] = out["layout"].stats.dispatch_bytes
    assert sent["fp8", False] <= 0.55 * sent["bf16", False] and sent["int8", False] == sent["fp8", False], sent
    assert all(sent[d, True] == sent[d, False] for d in ("bf16", "fp8", "int8")), sent  # one block per row: the same bytes


def test_compressed_dispatch_stays_within_the_codec_bound_and_sends_its_encoding():
    run_workers(_compressed, 2)


# The hierarchical dispatch (a row per (token, node) over the inter-node hop, fanned out inside the node): ep 4 as 2
# simulated nodes of 2 ranks (node = rank // devices_per_node), and ep 2 as 2 nodes of 1, in one process group.
HE, HK = 8, 3


def _hier_routing(rank: int, tokens: int, only: list[int] | None):
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    choices = torch.tensor(only if only is not None else list(range(HE)))
    index = torch.stack([choices[torch.randperm(len(choices), generator=g)[:HK]] for _ in range(tokens)]) if tokens else torch.zeros(0, HK, dtype=torch.long)
    return x, index, torch.rand(tokens, HK, generator=g, dtype=torch.float64)


def _run_mode(reference, dims, mode, per_node, x, index, weights, dispatch="none", overlap=False):
    sharded = copy.deepcopy(reference)
    layout = shard_experts(sharded, dims.build("cpu"), dispatch, mode, per_node, overlap=overlap)
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = sharded(x, index, weights)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return layout, [out.detach(), x.grad, weights.grad, *(p.grad.to_local() for p in sharded.parameters())]


def _remote_rows(index: torch.Tensor, node: int, experts_per_node: int) -> int:
    """(token, node) pairs of ``index`` bound for another node than ``node``: the hierarchical dispatch's rows."""
    nodes = index // experts_per_node
    return sum(len(set(row) - {node}) for row in nodes.tolist())


def _hierarchical(rank: int, world: int) -> None:
    torch.manual_seed(0)
    reference = PackedExperts(HE, H, I).double()
    for ep, per_node in ((4, 2), (2, 1)):
        dims = ParallelDims.resolve(world, data_parallel_size=world, expert_parallel_size=ep)
        node, experts_per_node = (rank % ep) // per_node, HE // (ep // per_node)
        cases = {
            "random": (12, None),
            "node 0 keeps its tokens": (12, list(range(experts_per_node)) if node == 0 else None),  # node 1 gets none from 0
            "rank 1 routes none": (0 if rank == 1 else 12, None),
        }
        for name, (tokens, only) in cases.items():
            x, index, weights = _hier_routing(rank, tokens, only)
            flat_layout, flat = _run_mode(reference, dims, "flat", per_node, x, index, weights)
            hier_layout, hier = _run_mode(reference, dims, "hierarchical", per_node, x, index, weights)
            single = reference(x, index, weights)
            torch.testing.assert_close(hier[0], single, rtol=0, atol=1e-12)
            for a, b in zip(hier, flat):  # the same routing: outputs, input, weight and expert gradients
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"ep{ep} {name}: {m}")
            overlapped_layout, overlapped = _run_mode(reference, dims, "hierarchical", per_node, x, index, weights, overlap=True)
            for a, b in zip(overlapped, flat):  # two chunks interleaved: the same again, and the same bytes
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"ep{ep} {name} overlapped: {m}")
            assert overlapped_layout.stats.link_bytes == hier_layout.stats.link_bytes, (ep, name)
            stats = hier_layout.stats
            # one row per (token, remote node) crosses the inter-node link, and nothing else of the rows
            rows = _remote_rows(index, node, experts_per_node)
            row_bytes, pair_bytes = H * 8, 8 + 4  # float64 rows; each pair's float64 weight and int32 code
            remote_pairs = int((index // experts_per_node != node).sum())
            assert stats.link_bytes["dispatch"]["inter"] == rows * row_bytes + remote_pairs * pair_bytes, (ep, name)
            # and each returns once: what the ranks send back is what they were sent (summed over the ranks)
            returned = torch.tensor([stats.link_bytes["combine"]["inter"], rows * row_bytes])
            dist.all_reduce(returned)
            assert returned[0] == returned[1], (ep, name, returned)
            assert stats.received_tokens == flat_layout.stats.received_tokens, (ep, name)
            if name == "node 0 keeps its tokens" and node == 0:
                assert stats.link_bytes["dispatch"]["inter"] == 0 == flat_layout.stats.link_bytes["dispatch"]["inter"]
            if name == "random":  # k = 3 of 8 experts on 2 nodes: fewer rows cross than the flat dispatch's
                assert stats.link_bytes["combine"]["inter"] < flat_layout.stats.link_bytes["combine"]["inter"], (ep, name)
    # fp8 on the inter-node hop: within the codec's bound, and fewer bytes than the flat fp8 dispatch's
    dims = ParallelDims.resolve(world, data_parallel_size=world, expert_parallel_size=4)
    torch.manual_seed(0)
    wide = PackedExperts(HE, 128, I).double()
    g = torch.Generator().manual_seed(rank)
    x, index = torch.randn(32, 128, generator=g, dtype=torch.float64), torch.stack([torch.randperm(HE, generator=g)[:HK] for _ in range(32)])
    weights = torch.rand(32, HK, generator=g, dtype=torch.float64)
    exact = wide(x, index, weights)
    flat_layout, _ = _run_mode(wide, dims, "flat", 2, x, index, weights, "fp8")
    hier_layout, hier = _run_mode(wide, dims, "hierarchical", 2, x, index, weights, "fp8")
    assert (hier[0] - exact).abs().max() / exact.abs().max() < 4 * 2**-4
    assert hier_layout.stats.link_bytes["dispatch"]["inter"] < flat_layout.stats.link_bytes["dispatch"]["inter"]
    # refused where it cannot apply: the ep group on one node, or its nodes not aligned
    for per_node, said in ((4, "sits on one node"), (3, "cannot split the ep group into nodes")):
        try:
            shard_experts(PackedExperts(HE, H, I).double(), dims.build("cpu"), "none", "hierarchical", per_node)
        except ValueError as err:
            assert said in str(err), str(err)
        else:
            raise AssertionError(f"expert_devices_per_node={per_node} was not refused")


def test_hierarchical_dispatch_equals_one_process_and_the_flat_dispatch_and_counts_its_hops():
    run_workers(_hierarchical, 4)


def _interleaving(rank: int, world: int) -> None:
    """The order of the all-to-alls' issues and waits and of the experts' forward and backward, overlapped: chunk 1's
    dispatch issued before chunk 0's experts run, and in backward an expert backward between a gradient all-to-all's
    issue and its wait (as it fails when the chunks run one after the other)."""
    events: list[str] = []
    real = dist.all_to_all_single

    class Logged:
        def __init__(self, work, n):
            self.work, self.n = work, n

        def wait(self):
            events.append(f"wait {self.n}")
            return self.work.wait()

        def get_future(self):
            return self.work.get_future()

    def all_to_all(*args, async_op=False, **kwargs):
        n = len([e for e in events if e.startswith("issue")])
        events.append(f"issue {n}" + (" async" if async_op else ""))
        work = real(*args, async_op=async_op, **kwargs)
        return Logged(work, n) if async_op else work

    class Act(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            events.append("experts")
            ctx.save_for_backward(x)
            return torch.nn.functional.silu(x)

        @staticmethod
        def backward(ctx, grad):
            events.append("experts backward")
            (x,) = ctx.saved_tensors
            s = torch.sigmoid(x)
            return grad * s * (1 + x * (1 - s))

    torch.manual_seed(0)
    experts = PackedExperts(E, H, I).double()
    experts.act_fn = Act.apply
    dims = ParallelDims.resolve(world, data_parallel_size=world, expert_parallel_size=world)
    shard_experts(experts, dims.build("cpu"), "none", overlap=True)
    events.clear()  # the takeover check ran the experts' own forward
    x, index, weights = _routing(12, rank, None, H)
    dist.all_to_all_single = all_to_all
    try:
        out = experts(x.requires_grad_(), index, weights)
        forward = len(events)
        out.sum().backward()
    finally:
        dist.all_to_all_single = real
    first_experts = events.index("experts")
    # both chunks' counts, then both chunks' dispatch (the rows and their weights) issued before chunk 0's experts run
    assert sum(e.endswith("async") for e in events[:first_experts]) == 6, events
    backward = events[forward:]
    hidden = [
        e for i, e in enumerate(backward) if e.endswith("async")
        and any(b == "experts backward" for b in backward[i:backward.index(f"wait {e.split()[1]}")])
    ]
    assert len(hidden) >= 2, backward  # a combine gradient, then a dispatch gradient, in flight over the other's experts


def test_overlapped_dispatch_runs_one_chunks_all_to_alls_while_the_other_computes():
    run_workers(_interleaving, 2)


# FP8 GEMMs (gemm_precision="fp8"): each expert's two products in e4m3 with a scale per row. A row's result does not
# depend on the rows beside it, so the dispatched experts equal the same products pair by pair on one process.
FH, FI = 32, 16  # widths FP8's kernels take (multiples of 16)


def _pair_by_pair(experts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair through FP8 GEMMs alone, summed per token in float64."""
    rows = []
    for t in range(x.shape[0]):
        row = x.new_zeros(1, x.shape[1])
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            gate, up = fp8_linear(x[t : t + 1], experts.gate_up_proj[e]).chunk(2, dim=-1)
            row = row + fp8_linear(experts.act_fn(gate) * up * weights[t, slot], experts.down_proj[e])
        rows.append(row)
    return torch.cat(rows)


def _fp8(rank: int, world: int) -> None:
    for overlap in (False, True):
        torch.manual_seed(0)
        reference = PackedExperts(E, FH, FI).double()
        sharded = copy.deepcopy(reference)
        dims = ParallelDims.resolve(world, data_parallel_size=world, expert_parallel_size=world)
        layout = shard_experts(sharded, dims.build("cpu"), "none", overlap=overlap)
        layout.fp8 = True
        x, index, weights = _routing(12, rank, None, FH)
        x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
        x_ep, w_ep = x.clone().requires_grad_(), weights.clone().requires_grad_()
        expected, actual = _pair_by_pair(reference, x_ref, index, w_ref), sharded(x_ep, index, w_ep)
        upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
        expected.backward(upstream)
        actual.backward(upstream)
        for param in reference.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        # float32 accumulation inside each product, the same codes either way: a few float32 roundings of the largest
        pairs = [(expected, actual), (x_ref.grad, x_ep.grad), (w_ref.grad, w_ep.grad)]
        pairs += [(p.grad.chunk(world)[rank], q.grad.to_local()) for p, q in zip(reference.parameters(), sharded.parameters())]
        for want, got in pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=16 * 2.0**-24 * float(want.abs().max()))
        with torch.no_grad():
            unquantized = reference(x, index, weights)
        assert (actual - unquantized).abs().max() > 1e-6  # FP8 ran: not the float64 product


def test_fp8_experts_equal_their_products_pair_by_pair_on_one_process():
    """Outputs, input, routing-weight and expert gradients; blocking and overlapped."""
    run_workers(_fp8, 2)
