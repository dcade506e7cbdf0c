"""The hierarchical dispatch: a token crosses the inter-node link once per node it is routed to, and is fanned out to
its experts' ranks inside the node; their outputs are summed inside the node before they return.

Contract (:func:`hierarchical_flow(experts, layout, hidden, top_k_index, top_k_weights, overlap)`, a flow of
:mod:`~lightning_ciuic.parallel.experts.overlap`; the same result as the flat dispatch's, up to the order of a float sum): with the layout's hops (``layout.hops``: ``ep_node``,
the ranks of this rank's local index on each node, and ``ep_local``, the ranks of its node; node ``n`` holds experts
``[n E/N, (n+1) E/N)``):

1. one row per (token, destination node), sorted by node then token, crosses ``ep_node`` (``codec``-encoded: the
   dispatch compression), with, per (token, expert) pair, its routing weight (working precision, differentiable) and
   its row and expert on that node (int32); the rows' and pairs' counts first (one small all-to-all, one device sync);
2. on the receiving rank, each pair is a flat dispatch over ``ep_local`` (:func:`~lightning_ciuic.parallel.experts.
   pairs.pairs_flow`: a row per pair to its expert's rank of the node, computed, returned, uncompressed), and the
   pairs' outputs times their weights are summed per row;
3. one row per (token, node) returns over ``ep_node`` in the working precision, and each token's rows are summed.

Backward runs the same exchanges in reverse. A rank with no token for a node, or none at all, takes part in every
collective. The bytes of each hop go to ``layout.stats`` by link (``ep_node``: ``"inter"``, ``ep_local``:
``"intra"``; the pairs' weights and int32 codes with the dispatch's).

The flow yields at each of its exchanges (the inter-node counts; the inter-node dispatch's three as one; the node's own counts, dispatch and
combine; the inter-node combine), asynchronous with ``overlap``: what the overlapped dispatch interleaves.

Under ``layout.assume_balanced`` (the planner's fake tensors) the sizes are those of :func:`balanced_node_index`'s
routing on every rank (a token's ``k`` pairs over ``m = min(k, N, layout.node_limit)`` consecutive nodes, node
``(t + j) mod N`` for slot ``s`` with ``s mod m = j``, spread over each node's experts; ``node_limit``: the most nodes
the model's grouped router lets a token reach, none: ``N``), whatever the router chose; a real run routed by it sends
the same bytes where the sizes divide evenly (the planner's even routing).

No Lightning imports.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_ciuic.parallel.experts.dispatch import all_to_all_timed
from lightning_ciuic.parallel.experts.layout import ExpertLayout
from lightning_ciuic.parallel.experts.overlap import Flow, exchange, together, transfer
from lightning_ciuic.parallel.experts.pairs import pairs_flow
from lightning_ciuic.parallel.experts.rows import sum_rows
from lightning_ciuic.tensors import local_tensor


def balanced_node_index(
    tokens: int, k: int, n_experts: int, nodes: int, limit: Optional[int] = None, device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The routing the planner assumes for the hierarchical dispatch (see the module docstring): ``[tokens, k]``."""
    spread = min(k, nodes, limit or nodes)
    t = torch.arange(tokens, device=device).unsqueeze(1)
    s = torch.arange(k, device=device).unsqueeze(0)
    per_node = n_experts // nodes
    node = (t + s % spread) % nodes
    return node * per_node + (t * k + s) % per_node


def _balanced_counts(tokens: int, k: int, nodes: int, limit: Optional[int], me: int) -> tuple[list[int], ...]:
    """Rows and pairs this rank sends to each node and receives from each under :func:`balanced_node_index` on every
    rank (each routes ``tokens``): the same from every source."""
    spread = min(k, nodes, limit or nodes)
    rows, pairs = [0] * nodes, [0] * nodes
    for residue in range(min(tokens, nodes)):
        count = tokens // nodes + (1 if residue < tokens % nodes else 0)  # tokens t with t mod N = residue
        for j in range(spread):
            node = (residue + j) % nodes
            rows[node] += count
            pairs[node] += count * len(range(j, k, spread))
    return rows, pairs, [rows[me]] * nodes, [pairs[me]] * nodes


def hierarchical_flow(
    self: nn.Module, layout: ExpertLayout, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    overlap: bool,
) -> Flow:
    """Route, send once per node, fan out, compute, sum in the node, send back, combine (see the module docstring), as
    a flow: it yields at each exchange, the inside of the node's included, asynchronous with ``overlap``."""
    inter, intra = layout.hops
    nodes = inter.size()
    n_experts = local_tensor(self.gate_up_proj).shape[0] * layout.ep_mesh.size()
    per_node = n_experts // nodes
    tokens, k = top_k_index.shape
    device = top_k_index.device
    flat = top_k_index.reshape(-1)
    if layout.assume_balanced:
        sizes = _balanced_counts(tokens, k, nodes, layout.node_limit, inter.get_local_rank())
        counts = flat.new_empty(2 * nodes)
        all_to_all_timed(torch.empty_like(counts), counts, [2] * nodes, [2] * nodes, layout, "counts", inter)
        send_rows, send_pairs, recv_rows, recv_pairs = sizes
        row_token = flat.new_zeros(sum(send_rows))
        order, code = flat.new_zeros(flat.numel()), flat.new_zeros(flat.numel(), dtype=torch.int32)
    else:
        pair_node = flat // per_node
        pair_token = torch.arange(flat.numel(), device=device) // k
        span = max(tokens, 1)
        keys, pair_row = torch.unique(pair_node * span + pair_token, sorted=True, return_inverse=True)
        row_node, row_token = keys // span, keys % span
        rows_to = torch.bincount(row_node, minlength=nodes)
        pairs_to = torch.bincount(pair_node, minlength=nodes)
        order = pair_row.argsort(stable=True)  # the pairs by row, so by node
        block_start = rows_to.cumsum(0) - rows_to
        sorted_node = pair_node.index_select(0, order)
        row_in_block = pair_row.index_select(0, order) - block_start.index_select(0, sorted_node)
        code = (row_in_block * per_node + flat.index_select(0, order) - sorted_node * per_node).to(torch.int32)
        counts = torch.stack([rows_to, pairs_to], dim=1).reshape(-1)
        arriving = yield transfer(counts, [2] * nodes, [2] * nodes, layout, "counts", inter, overlap)
        both = torch.cat([counts.view(nodes, 2).t().reshape(-1), arriving.view(nodes, 2).t().reshape(-1)]).tolist()  # one sync
        send_rows, send_pairs = both[:nodes], both[nodes : 2 * nodes]
        recv_rows, recv_pairs = both[2 * nodes : 3 * nodes], both[3 * nodes :]
    # 1. a row per (token, node) and each pair's weight and code, over the inter-node hop
    received, weights, codes = yield together(
        exchange(hidden.index_select(0, row_token), send_rows, recv_rows, layout, layout.codec, "dispatch", inter, "inter", overlap),
        exchange(
            top_k_weights.reshape(-1, 1).index_select(0, order), send_pairs, recv_pairs, layout, None, "dispatch", inter,
            "inter", overlap, rows_counted=False,
        ),
        _exchange_codes(code, send_pairs, recv_pairs, layout, inter, overlap),
    )
    # 2. on this node: each pair to its expert's rank, the outputs weighted and summed per row
    if layout.assume_balanced:
        row_of_pair, expert_of_pair = codes.new_zeros(codes.numel(), dtype=torch.long), codes.new_zeros(codes.numel(), dtype=torch.long)
    else:
        source = torch.repeat_interleave(torch.arange(nodes, device=device), torch.tensor(recv_pairs, device=device), output_size=sum(recv_pairs))
        source_start = torch.tensor(recv_rows, device=device).cumsum(0) - torch.tensor(recv_rows, device=device)
        codes = codes.long()
        row_of_pair = source_start.index_select(0, source) + codes // per_node
        expert_of_pair = codes % per_node
    summed = yield from pairs_flow(self, layout, received, row_of_pair, expert_of_pair, weights.reshape(-1), intra, None, "intra", overlap)
    # 3. a row per (token, node) back, summed per token
    returned = yield exchange(summed, recv_rows, send_rows, layout, None, "combine", inter, "inter", overlap)
    return sum_rows(returned, row_token, tokens).to(hidden.dtype)


def _exchange_codes(code: torch.Tensor, send: list[int], recv: list[int], layout: ExpertLayout, inter, overlap: bool):
    """Each pair's (row, expert) code to the node it goes to, pending; its bytes counted with the dispatch's."""
    arrived = transfer(code, send, recv, layout, "dispatch codes", inter, overlap)
    size = code.element_size()
    layout.stats.count("dispatch", [n * size for n in send], [0] * len(send), inter.get_local_rank(), ["inter"] * len(send))
    return arrived
