"""The nodes of the expert-parallel group: which ep ranks share a node, the two hops of the hierarchical dispatch, and
the node limit of a router's expert groups.

Contract:

* :func:`expert_nodes(ep_mesh, devices_per_node)` -> :class:`ExpertNodes`: node of a global rank ``rank //
  devices_per_node`` (consecutive ranks on a node, as torchrun and the cluster environments place them; ``None``: the
  whole group on one node). ``count`` nodes of ``per_node`` ep ranks each, ``link`` the link to each ep rank from this
  one (``"intra"``/``"inter"``). ``aligned`` when, in every ep group of the world, the ep ranks of one node are
  ``per_node`` consecutive ep indices (then node ``n`` holds experts ``[n E/count, (n+1) E/count)``); ``why_not`` says
  otherwise.
* :meth:`ExpertNodes.hops` (a collective call, once): the ep mesh unflattened into ``(ep_node, ep_local)``:
  ``ep_node`` the ranks of the same local index on each node (the inter-node hop), ``ep_local`` the ranks of one node
  (the intra-node hop). Refused (``ValueError``, what was given and what works) where the hierarchical dispatch cannot
  apply: the group on one node, or its nodes not aligned.
* :func:`group_alignment(module, n_experts, nodes)`: for every router of ``module`` with expert groups (transformers'
  DeepSeek-V3 ``num_group``/``topk_group``, the example model's ``n_group``/``topk_group``), ``None`` when each node
  holds whole groups (so the group limit is a node limit: a token reaches at most ``topk_group`` nodes), else a
  sentence saying what was given, how many nodes a token may reach, and what works. :func:`node_limit`: the most
  nodes a token of those routers may reach (``None``: no grouped router), what the planner's balanced routing assumes.
* :func:`limit_nodes(module, experts, nodes, limit)`: the opt-in node limit for a model without groups
  (``expert_node_limit``): its routers that route by :func:`group_limited_top_k` get one group per node and ``limit``
  groups per token, a change of the model's maths it asks for; refused (``ValueError``: what was given, what works)
  on one node, with a limit of every node, where a router already limits groups, or where a layer's router cannot.
* :func:`group_limited_top_k(scores, k, n_group, topk_group)`: DeepSeek-V3's group-limited routing (its node-limited
  routing when groups are nodes): the experts in ``n_group`` equal consecutive groups, each token's groups ranked by
  the sum of its ``max(1, k // topk_group)`` highest scores in each (the report's rule, transformers' top-2 for
  DeepSeek-V3's 8 of 4 groups), its top ``k`` taken among the experts of its best ``topk_group`` groups. Returns the
  indices ``[T, k]``; ``n_group == 1`` is plain top-k. Opt-in: a model that calls it changes its routing.

No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic import compat

HOP_AXES = ("ep_node", "ep_local")  # the inter-node and the intra-node hop of the hierarchical dispatch


@dataclass
class ExpertNodes:
    """Where the ep ranks sit (see the module docstring)."""

    devices_per_node: Optional[int]
    ranks: list[int]  # this rank's ep group, global ranks in ep order
    count: int  # nodes of the group
    per_node: int  # ep ranks on each node
    link: list[str]  # from this rank to each ep rank: "intra" or "inter"
    why_not: Optional[str]  # why the nodes are not aligned (None: aligned)
    _hops: Optional[DeviceMesh] = field(default=None, repr=False)

    @property
    def aligned(self) -> bool:
        return self.why_not is None

    def hops(self, ep_mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """The inter-node (``ep_node``) and intra-node (``ep_local``) meshes, made once (a collective call)."""
        if self.count < 2:
            raise ValueError(
                f"expert_dispatch='hierarchical' sends a token once to each node and fans it out inside the node, and"
                f" the ep group {self.ranks} sits on one node (expert_devices_per_node={self.devices_per_node}):"
                " there is no inter-node hop to save. Use expert_dispatch='flat', or expert-parallel ranks over"
                " several nodes."
            )
        if not self.aligned:
            raise ValueError(f"expert_dispatch='hierarchical' cannot split the ep group into nodes: {self.why_not}.")
        if self._hops is None:
            self._hops = compat.unflatten_mesh(ep_mesh, str(ep_mesh.mesh_dim_names[0]), (self.count, self.per_node), HOP_AXES)
        return self._hops[HOP_AXES[0]], self._hops[HOP_AXES[1]]


def expert_nodes(ep_mesh: DeviceMesh, devices_per_node: Optional[int]) -> ExpertNodes:
    """The nodes of ``ep_mesh``'s groups (see the module docstring)."""
    ranks = [int(r) for r in ep_mesh.mesh.flatten().tolist()]
    me = ep_mesh.get_local_rank()
    if devices_per_node is None:
        return ExpertNodes(None, ranks, 1, len(ranks), ["intra"] * len(ranks), None)
    node = [r // devices_per_node for r in ranks]
    link = ["intra" if n == node[me] else "inter" for n in node]
    per_node = node.count(node[me])
    count = len(set(node))
    why_not = None
    for group in compat.mesh_groups(ep_mesh):
        nodes = [r // devices_per_node for r in group]
        blocks = [nodes[i : i + per_node] for i in range(0, len(nodes), per_node)]
        if len(nodes) % per_node or any(len(set(block)) != 1 for block in blocks) or len({block[0] for block in blocks}) != len(blocks):
            why_not = (
                f"with expert_devices_per_node={devices_per_node}, the ep group {group} (global ranks, in ep order) puts"
                f" its ranks on nodes {nodes}: the hierarchical dispatch needs each node to hold the same number of"
                " consecutive ep ranks (ep ranks are neighbouring data-parallel ranks, tensor-parallel peers"
                " innermost: choose ep, tp and the devices per node so that ep * tp is a multiple of the devices per"
                " node, or divides them)"
            )
            break
    return ExpertNodes(devices_per_node, ranks, count, per_node, link, why_not)


def _router_groups(module: nn.Module) -> list[tuple[str, int, int]]:
    """``(name, groups, groups per token)`` of every router of ``module`` with expert groups."""
    found = []
    for name, sub in module.named_modules():
        groups = getattr(sub, "num_group", getattr(sub, "n_group", None))
        limit = getattr(sub, "topk_group", None)
        if isinstance(groups, int) and isinstance(limit, int) and groups > 1:
            found.append((name, groups, limit))
    return found


def _reach(groups: int, limit: int, n_experts: int, nodes: int) -> int:
    """The most nodes a token limited to ``limit`` of ``groups`` expert groups may reach over ``nodes`` nodes."""
    if groups % nodes == 0:  # each node holds whole groups
        return min(limit, nodes)
    per_group, per_node = n_experts // groups, n_experts // nodes
    spans = -(-per_group // per_node) + (1 if per_group % per_node or per_group < per_node else 0)
    return min(nodes, limit * spans)


def node_limit(module: nn.Module, n_experts: int, nodes: ExpertNodes) -> Optional[int]:
    """The most nodes a token of ``module``'s grouped routers may reach (``None``: no router limits its groups)."""
    reaches = [_reach(groups, limit, n_experts, nodes.count) for _, groups, limit in _router_groups(module)]
    return max(reaches) if reaches else None


def group_alignment(module: nn.Module, n_experts: int, nodes: ExpertNodes) -> Optional[str]:
    """``None`` when every grouped router's groups are whole on the nodes, else what breaks it (module docstring)."""
    if nodes.count < 2:
        return None
    for name, groups, limit in _router_groups(module):
        if groups % nodes.count == 0:
            continue
        per_group, per_node = n_experts // groups, n_experts // nodes.count
        works = sorted({g for g in range(1, groups + 1) if groups % g == 0})
        return (
            f"the router {name} limits each token to {limit} of {groups} expert groups ({per_group} experts each), and"
            f" ep={len(nodes.ranks)} over {nodes.count} nodes of {nodes.per_node} ranks (expert_devices_per_node="
            f"{nodes.devices_per_node}) puts {per_node} experts on a node: a group spans nodes, so a token may reach up"
            f" to {_reach(groups, limit, n_experts, nodes.count)} nodes, not {limit}. Its group limit is a node limit"
            f" when each node holds whole groups: ep over a number of nodes among {works} (expert_parallel_size = nodes"
            " x ep ranks per node)"
        )
    return None


def limit_nodes(module: nn.Module, experts: list[str], nodes: ExpertNodes, limit: int) -> None:
    """The opt-in node limit (``expert_node_limit``): every router of ``module`` that routes by groups
    (:func:`group_limited_top_k`: ``n_group``/``num_group`` and ``topk_group`` attributes it reads) gets one group per
    node and ``limit`` groups per token. Raises ``ValueError``, before anything changes, naming what was given and what
    works: the ep group on one node, a limit of all the nodes, a router that already limits its groups, or fewer such
    routers than mixture-of-experts layers (``experts``: their names)."""
    given = f"expert_node_limit={limit}"
    if nodes.count < 2:
        raise ValueError(
            f"{given} limits each token to the experts of {limit} nodes, and the ep group {nodes.ranks} sits on one node"
            f" (expert_devices_per_node={nodes.devices_per_node}): leave it unset, or place the ep ranks over several nodes."
        )
    if not 1 <= limit < nodes.count:
        raise ValueError(
            f"{given}: the ep group spans {nodes.count} nodes, so a limit of {limit} limits nothing; use 1 to"
            f" {nodes.count - 1}, or leave it unset."
        )
    routers = [(name, sub) for name, sub in module.named_modules() if _group_attribute(sub) is not None]
    grouped = [name for name, groups, _ in _router_groups(module)]
    if grouped:
        raise ValueError(
            f"{given}, and the routers {grouped} already limit each token to some expert groups (their n_group and"
            " topk_group): their group limit is the node limit where each node holds whole groups; leave"
            " expert_node_limit unset."
        )
    if len(routers) < len(experts):
        raise ValueError(
            f"{given} changes how each router picks its experts, and of the {len(experts)} mixture-of-experts layers"
            f" ({experts[:3]}{'...' if len(experts) > 3 else ''}) only {len(routers)} have a router the pack can"
            " limit: one that routes by group_limited_top_k(scores, k, n_group, topk_group) and holds n_group (or"
            " num_group) and topk_group, as the example model and transformers' DeepSeek-V3 do (Mixtral's and"
            " Qwen3-MoE's routers do not). Leave it unset, or route by group_limited_top_k."
        )
    for _, router in routers:
        setattr(router, _group_attribute(router), nodes.count)
        router.topk_group = limit


def _group_attribute(module: nn.Module) -> Optional[str]:
    """The name of a grouped router's group count (``n_group`` or ``num_group``), if it has one and ``topk_group``."""
    for name in ("num_group", "n_group"):
        if isinstance(getattr(module, name, None), int) and isinstance(getattr(module, "topk_group", None), int):
            return name
    return None


def group_limited_top_k(scores: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited top-k of ``scores`` ``[T, E]`` (see the module docstring)."""
    if n_group == 1:
        return scores.topk(k, dim=-1).indices
    tokens, n_experts = scores.shape
    if n_experts % n_group or not 1 <= topk_group <= n_group or k > topk_group * (n_experts // n_group):
        raise ValueError(
            f"group-limited routing of {n_experts} experts in n_group={n_group} groups, topk_group={topk_group}, top"
            f" {k}: the groups must divide the experts and the {topk_group} groups hold at least {k} experts."
        )
    grouped = scores.view(tokens, n_group, n_experts // n_group)
    best = max(1, k // topk_group)
    group_scores = grouped.topk(min(best, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    allowed = mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, n_experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
