"""(row, expert) pairs to their experts' ranks and back: the one exchange both dispatches run.

Contract: :func:`pairs_flow(experts, layout, hidden, pair_row, pair_expert, pair_weight, mesh, codec, hop, overlap)`,
a flow (:mod:`~lightning_ciuic.parallel.experts.overlap`: ``run_alone`` runs it, ``run_interleaved`` two of them): the
pairs sorted by expert (stable), their routing exchanged over ``mesh`` (:mod:`~lightning_ciuic.parallel.experts.dispatch`;
as if balanced under ``layout.assume_balanced``), ``hidden[pair_row]`` sent to the rank of ``mesh`` holding each
pair's expert (``codec``-encoded) with the pair's weight (in ``hidden``'s dtype, beside the rows: its bytes counted
with the dispatch's), the local experts run on what arrived, each intermediate times its weight
(:func:`~lightning_ciuic.parallel.experts.gemm.run_local_experts`, gradients scaled by ``layout.grad_scale``), the
results sent back in the working precision, and each row's weighted outputs summed on the sender: ``[hidden rows, H]``.
The weights' gradient is computed by the experts' ranks and returns with the dispatch's gradient. ``pair_expert`` indexes the experts ``mesh`` holds, rank ``j`` the ``j``-th share. ``hop``: the
link both exchanges cross (``"inter"``/``"intra"``), ``None``: each rank's own (the flat dispatch over the ep group).
The flat dispatch is this over the ep group, a row per token; the hierarchical one runs it inside each node.
The flow yields at its dispatch and its combine exchange, and at the routing counts' before them, asynchronous with
``overlap``: what the overlapped dispatch interleaves.

No Lightning imports.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.parallel.experts.dispatch import balanced_routing, routing_of
from lightning_ciuic.parallel.experts.gemm import run_local_experts
from lightning_ciuic.parallel.experts.layout import ExpertLayout
from lightning_ciuic.parallel.experts.overlap import Flow, exchange, together, transfer
from lightning_ciuic.parallel.experts.rows import permuted_rows, sum_rows
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.wire.codecs import Codec


def pairs_flow(
    self: nn.Module, layout: ExpertLayout, hidden: torch.Tensor, pair_row: torch.Tensor, pair_expert: torch.Tensor,
    pair_weight: torch.Tensor, mesh: DeviceMesh, codec: Optional[Codec], hop: Optional[str], overlap: bool,
) -> Flow:
    """The (row, expert) pairs to the experts' ranks of ``mesh`` (which holds ``self``'s experts of the pairs, in
    order) and back: ``hidden[pair_row]`` sent (``codec``-encoded), computed, returned in the working precision, and
    each row's outputs summed with the pairs' weights; ``hop``: the link the exchanges cross (``None``: each rank's).
    A flow: it yields at its three exchanges (counts, dispatch, combine), asynchronous with ``overlap``."""
    n_experts = local_tensor(self.gate_up_proj).shape[0] * mesh.size()
    order = pair_expert.argsort(stable=True)  # pairs grouped by expert, so by destination rank
    source_row = pair_row.index_select(0, order)
    if layout.assume_balanced:
        routed = balanced_routing(layout, pair_expert, n_experts, mesh)
    else:  # the counts exchanged (one small all-to-all), then the sizes (one device sync)
        counts, share = torch.bincount(pair_expert, minlength=n_experts), [n_experts // mesh.size()] * mesh.size()
        routed = routing_of(counts, (yield transfer(counts, share, share, layout, "counts", mesh, overlap)), mesh.size())
    weights = pair_weight.index_select(0, order).to(hidden.dtype).unsqueeze(-1)
    received, received_weights = yield together(
        exchange(hidden.index_select(0, source_row), routed.send_rows, routed.recv_rows, layout, codec, "dispatch", mesh, hop, overlap),
        exchange(weights, routed.send_rows, routed.recv_rows, layout, None, "dispatch", mesh, hop, overlap, rows_counted=False),
    )
    # what arrived is grouped by source rank, then expert; the experts want it grouped by expert
    by_expert = routed.expert_of_row.argsort(stable=True)
    computed = run_local_experts(
        self, received.index_select(0, by_expert), routed.per_local_expert, layout.grad_scale,
        received_weights.reshape(-1).index_select(0, by_expert), layout.input_codec, layout.fp8,
    )
    layout.stats.received_tokens += computed.shape[0]
    unsorted = permuted_rows(computed, by_expert)
    returned = yield exchange(unsorted, routed.recv_rows, routed.send_rows, layout, None, "combine", mesh, hop, overlap)
    return sum_rows(returned, source_row, hidden.shape[0]).to(hidden.dtype)
