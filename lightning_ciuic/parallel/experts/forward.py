"""The packed experts' forward under expert parallelism: bound to each sharded module in place of its own.

Contract (:func:`expert_parallel_forward(self, hidden, top_k_index, top_k_weights)`): the ``T k`` (token, expert)
pairs sorted by expert, their routing exchanged (:mod:`~lightning_ciuic.parallel.experts.dispatch`), the rows sent to
their experts' ranks (``codec``-encoded: the dispatch compression), the local experts run on what arrived
(:func:`~lightning_ciuic.parallel.experts.gemm.run_local_experts`, their gradients scaled by the layout's
``grad_scale``), the results sent back in the working precision, and each token's outputs summed with its routing
weights, on the sender (the router's gradient stays local): :func:`~lightning_ciuic.parallel.experts.pairs.pairs_flow`
over the ep group. With ``layout.mode == "hierarchical"`` the same result by
:func:`~lightning_ciuic.parallel.experts.hierarchical.hierarchical_flow` (once per node over the
inter-node hop, fanned out inside the node). A rank that receives no token still takes part in every collective.
Backward runs the same exchanges in reverse, in the working precision. With ``layout.overlap`` the tokens are cut in
two chunks (:func:`~lightning_ciuic.parallel.experts.overlap.chunks`: the first a token longer where they do not
divide), each dispatched, computed and combined as above, interleaved
(:func:`~lightning_ciuic.parallel.experts.overlap.run_interleaved`: one chunk's all-to-alls in flight while the other
computes, forward and backward), their outputs concatenated: the same routing and the same result (the routing and
any statistics of it are the caller's, over all the tokens). Inside one side of DualPipeV's forward-backward pairs
(:mod:`~lightning_ciuic.parallel.paired_overlap`) the tokens go as one flow of asynchronous exchanges, in flight while
the pair's other micro-batch computes.

Over tensor-parallel peers (``layout.tp_mesh``: ``ep`` takes the tp peers too, which hold the same tokens): each peer
dispatches its share of the tokens, and the shares' outputs are all-gathered; the inputs' gradients are summed over the
peers (Megatron's copy-to-tensor-parallel-region), each peer keeps its share's output gradient.

No Lightning imports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_ciuic.parallel import paired_overlap
from lightning_ciuic.parallel.experts.hierarchical import hierarchical_flow
from lightning_ciuic.parallel.experts.layout import ExpertLayout
from lightning_ciuic.parallel.experts.overlap import Flow, chunks, run_alone, run_interleaved
from lightning_ciuic.parallel.experts.pairs import pairs_flow
from lightning_ciuic.parallel.tensor import sum_grad_over

LAYOUT_ATTRIBUTE = "_expert_layout"  # where shard_experts keeps a sharded module's ExpertLayout


def expert_parallel_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The packed experts' forward under expert parallelism (see the module docstring)."""
    layout: ExpertLayout = getattr(self, LAYOUT_ATTRIBUTE)
    if layout.tp_mesh is not None:
        return _split_over_tensor_parallel_peers(self, layout, hidden, top_k_index, top_k_weights)
    return _dispatch_and_combine(self, layout, hidden, top_k_index, top_k_weights)


def _split_over_tensor_parallel_peers(experts, layout, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """ep includes the tp peers, which hold the same tokens: each dispatches its share and the shares' outputs are
    gathered. The inputs' gradients are summed over the peers (each saw one share), the output's gradient is the
    same on every peer (the rest of the layer is replicated or tensor-parallel), so each keeps its share's."""
    tp_mesh = layout.tp_mesh
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    tokens = hidden.shape[0]
    sizes = [tokens // tp + (1 if i < tokens % tp else 0) for i in range(tp)]
    start = sum(sizes[:rank])
    share = slice(start, start + sizes[rank])
    hidden, top_k_weights = sum_grad_over(hidden, tp_mesh), sum_grad_over(top_k_weights, tp_mesh)
    out = _dispatch_and_combine(experts, layout, hidden[share], top_k_index[share], top_k_weights[share])
    return _GatherShares.apply(out, sizes, rank, tp_mesh.get_group())


class _GatherShares(torch.autograd.Function):
    """Forward: every peer's rows (``sizes[i]`` from peer ``i``) concatenated; backward: this peer's rows' gradient."""

    @staticmethod
    def forward(ctx, rows, sizes, rank, group):  # type: ignore[override]
        ctx.share = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        widest = max(sizes)
        padded = rows.new_zeros((widest, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(gathered, sizes)])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad[ctx.share].contiguous(), None, None, None


def _dispatch_and_combine(self, layout: ExpertLayout, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """Route, send, compute, send back, combine (see the module docstring): flat, or hierarchical by the layout; with
    ``layout.overlap`` in two chunks of the tokens, interleaved."""
    flow = hierarchical_flow if layout.mode == "hierarchical" else _flat_flow
    if paired_overlap.in_pair():  # the other micro-batch of the pair computes while this one's exchanges are in flight
        return run_alone(flow(self, layout, hidden, top_k_index, top_k_weights, True))
    if not layout.overlap:
        return run_alone(flow(self, layout, hidden, top_k_index, top_k_weights, False))
    flows = [flow(self, layout, hidden[part], top_k_index[part], top_k_weights[part], True) for part in chunks(hidden.shape[0])]
    return torch.cat(run_interleaved(flows))


def _flat_flow(self, layout: ExpertLayout, hidden, top_k_index, top_k_weights, overlap: bool) -> Flow:
    """The flat dispatch of these tokens over the ep group, a row per (token, expert) pair, as a flow."""
    k = top_k_index.shape[1]
    pair_row = torch.arange(top_k_index.numel(), device=top_k_index.device) // k
    return pairs_flow(
        self, layout, hidden, pair_row, top_k_index.reshape(-1), top_k_weights.reshape(-1), layout.ep_mesh, layout.codec,
        None, overlap,
    )
