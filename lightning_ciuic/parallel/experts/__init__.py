"""Expert parallelism: each rank of the ``ep`` axis holds its share of every mixture-of-experts layer's experts, and
tokens travel to the rank that holds their expert and back (docs/expert_parallel.md).

One module per job, each with its contract:

* :mod:`.layout`: which modules hold packed experts (:func:`packed_experts`), the :class:`ExpertLayout` sharding makes,
  the dispatch compressions and their codecs, :class:`DispatchStats`.
* :mod:`.shard`: :func:`shard_experts`, the entry point (checks, then shards and replaces the forwards).
* :mod:`.takeover`: the form expert parallelism computes and which modules it may take over (:func:`check_takeover`).
* :mod:`.forward`: the replaced forward (:func:`expert_parallel_forward`): route, dispatch, compute, combine; the
  split over tensor-parallel peers.
* :mod:`.dispatch`: the routing counted and exchanged, the rows' all-to-alls (compressed dispatch, timed).
* :mod:`.pairs`: (row, expert) pairs to their experts' ranks and back (:func:`pairs_flow`), what both dispatches run.
* :mod:`.overlap`: exchanges waited later and the schedule that interleaves two chunks' dispatches (one chunk's
  all-to-alls in flight while the other computes, forward and backward), and what they were exposed.
* :mod:`.hierarchical`: the hierarchical dispatch (once per node over the inter-node hop, fanned out inside the node).
* :mod:`.nodes`: which ep ranks share a node, the hierarchical dispatch's two hops, a router's group limit as a node
  limit (:func:`group_alignment`) and DeepSeek-V3's group-limited routing (:func:`group_limited_top_k`).
* :mod:`.gemm`: the local experts run by grouped GEMM or a loop (:func:`run_local_experts`).
* :mod:`.grad_scale`: the experts' gradient scale (``1/ep_data_ranks``).
* :mod:`.rows`: rows summed and permuted by index, autograd keeping only what their backward reads.
* :mod:`.storage`: the experts' input rows kept for backward in a codec's encoding (:class:`kept_encoded`).
* :mod:`.counts`: :class:`RoutedTokens`, the tokens routed to each expert.

The names below are the public ones, importable from here.

No Lightning imports.
"""

from lightning_ciuic.parallel.experts.counts import RoutedTokens
from lightning_ciuic.parallel.experts.forward import expert_parallel_forward
from lightning_ciuic.parallel.experts.hierarchical import balanced_node_index
from lightning_ciuic.parallel.experts.layout import (
    DISPATCH_COMPRESSIONS,
    DISPATCH_MODES,
    DispatchCompression,
    DispatchMode,
    DispatchStats,
    ExpertLayout,
    dispatch_codec,
    experts_parent,
    is_packed_experts,
    packed_experts,
    parameters_per_token,
)
from lightning_ciuic.parallel.experts.nodes import ExpertNodes, group_alignment, group_limited_top_k
from lightning_ciuic.parallel.experts.shard import shard_experts
from lightning_ciuic.parallel.experts.takeover import FORM, check_takeover, dispatched_output

__all__ = [
    "DISPATCH_COMPRESSIONS",
    "DISPATCH_MODES",
    "FORM",
    "DispatchCompression",
    "DispatchMode",
    "DispatchStats",
    "ExpertLayout",
    "ExpertNodes",
    "balanced_node_index",
    "RoutedTokens",
    "check_takeover",
    "dispatch_codec",
    "experts_parent",
    "dispatched_output",
    "expert_parallel_forward",
    "group_alignment",
    "group_limited_top_k",
    "is_packed_experts",
    "packed_experts",
    "parameters_per_token",
    "shard_experts",
]
