"""Which modules hold packed experts, and the layout expert parallelism makes of them.

Contract:

* **Packed experts** (:func:`packed_experts`): a layer's experts held as two 3-D parameters, ``gate_up_proj``
  ``[E, 2I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``, and an ``act_fn``, computing
  ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``. transformers' DeepSeek-V3,
  Qwen3-MoE and Mixtral experts are such modules, and so is the pack's example model's. Found by their parameters'
  and ``act_fn``'s names and ranks (what the balance callbacks and the monitor count).
* :func:`experts_parent`: the module holding a packed-experts module, where its router sits.
* :func:`parameters_per_token`: the parameters one token's forward through a module uses, each packed-experts module
  counted for the ``top_k`` of its experts its router picks (what a pipeline's stages are balanced by).
* :class:`ExpertLayout`: what :func:`~lightning_ciuic.parallel.experts.shard.shard_experts` made: the expert view of
  the mesh (``(pp, [dp_replicate,] edp, ep, tp)``), its ``ep`` mesh, the sharded modules, the dispatch compression and
  its codec (:func:`dispatch_codec`), the experts' gradient scale
  (:func:`~lightning_ciuic.parallel.experts.grad_scale.expert_grad_scale`), the tensor-parallel peers that split
  their tokens (``dims.ep_over_tp``), a :class:`~lightning_ciuic.wire.timing.DeviceClock` and the
  :class:`DispatchStats` the forwards add to. ``assume_balanced``: route as if balanced (the planner's fake tensors).
  ``mode``: ``"flat"`` (one all-to-all over the ep group, a row per (token, expert)) or ``"hierarchical"`` (a row per
  (token, node) over the inter-node hop, fanned out inside the node: :mod:`~lightning_ciuic.parallel.experts.hierarchical`),
  the nodes from ``devices_per_node`` (:mod:`~lightning_ciuic.parallel.experts.nodes`; ``hops`` the two hops' meshes,
  hierarchical only, refused where it cannot apply). ``overlap``: the tokens of each call in two chunks whose
  all-to-alls run while the other chunk computes (:mod:`~lightning_ciuic.parallel.experts.overlap`).
* :class:`DispatchStats`: running totals of the bytes each way (and by the link they crossed, ``link_bytes``), the rows
  this rank's experts computed, the all-to-alls' wall time (``seconds``: from issue to completion) and the part of it
  the caller was blocked on them (``exposed_seconds``: the same without overlap).

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.wire.codecs import BlockFP8, BlockInt8, Codec, HalfPrecision
from lightning_ciuic.wire.timing import DeviceClock
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.dims import Meshes, ParallelDims
from lightning_ciuic.parallel.experts.grad_scale import expert_grad_scale
from lightning_ciuic.parallel.experts.nodes import ExpertNodes, expert_nodes

DispatchCompression = Literal["none", "bf16", "fp8", "int8"]
DISPATCH_COMPRESSIONS = ("none", "bf16", "fp8", "int8")
DispatchMode = Literal["flat", "hierarchical"]
DISPATCH_MODES = ("flat", "hierarchical")
DISPATCH_BLOCK = 128  # values per scale of the fp8/int8 dispatch (DeepSeek-V3's 1x128 activation tiles)


def dispatch_codec(name: str, option: str = "expert_dispatch_compression") -> Optional[Codec]:
    """The codec the dispatched rows cross the all-to-all with (``None``: their own dtype, exactly); ``option``: the
    argument that named it, for the error."""
    codecs = {"none": None, "bf16": HalfPrecision(torch.bfloat16), "fp8": BlockFP8(DISPATCH_BLOCK), "int8": BlockInt8(DISPATCH_BLOCK)}
    if name not in codecs:
        raise ValueError(f"{option}={name!r}: use one of {list(DISPATCH_COMPRESSIONS)}.")
    return codecs[name]


def is_packed_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds its experts packed (see the module docstring)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3 and down.dim() == 3
        and gate_up.shape[0] == down.shape[0] and callable(getattr(module, "act_fn", None))
    )


def packed_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every packed-experts module inside ``module``."""
    return [(name, sub) for name, sub in module.named_modules() if is_packed_experts(sub)]


def experts_parent(module: nn.Module, name: str) -> nn.Module:
    """The module of ``module`` that holds the packed experts named ``name`` (``module`` itself for a top-level name):
    where their router sits."""
    return module.get_submodule(name.rpartition(".")[0])


def parameters_per_token(module: nn.Module) -> int:
    """The parameters one token's forward through ``module`` passes: all of them, but of each packed-experts module
    only ``top_k / E`` (its router's ``top_k`` of its ``E`` experts): twice that is the forward's FLOPs per token,
    attention's aside. ``top_k`` is the int attribute of that name on the experts' parent module or a module inside it
    (transformers' routers and sparse blocks, the example model's); experts without one count whole."""
    total = sum(p.numel() for p in module.parameters())
    for name, experts in packed_experts(module):
        router = experts_parent(module, name)
        top_k = next((m.top_k for m in router.modules() if isinstance(getattr(m, "top_k", None), int)), None)
        if top_k is None:
            continue
        held = sum(p.numel() for p in experts.parameters())
        total -= held - held * top_k // experts.gate_up_proj.shape[0]
    return total


@dataclass
class DispatchStats:
    """What the expert-parallel forwards of one layout moved (running totals)."""

    dispatch_bytes: int = 0  # sent by this rank to other ranks' experts (encoded)
    dispatch_rows: int = 0  # the rows (token, expert pairs) those bytes carried
    combine_bytes: int = 0  # results this rank sent back to the ranks that routed them
    combine_rows: int = 0
    received_tokens: int = 0  # rows this rank's experts computed
    seconds: float = 0.0  # the token all-to-alls' wall time, forward and backward (waiting for the other ranks included)
    exposed_seconds: float = 0.0  # of it, the time the caller was blocked on them (all of it without overlap)
    # the same bytes (forward) by the link they crossed: {"dispatch": {"intra": n, "inter": n}, "combine": {...}}
    link_bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: {direction: {"intra": 0, "inter": 0} for direction in ("dispatch", "combine")}
    )

    def add_seconds(self, seconds: float) -> None:
        self.seconds += seconds

    def add_exposed(self, seconds: float) -> None:
        self.exposed_seconds += seconds

    def count(self, direction: str, send_bytes: Sequence[int], send_rows: Sequence[int], me: int, links: Sequence[str]) -> None:
        """An exchange's bytes and rows to the other ranks (``links[j]``: the link to rank ``j`` of its group)."""
        setattr(self, f"{direction}_bytes", getattr(self, f"{direction}_bytes") + sum(send_bytes) - send_bytes[me])
        setattr(self, f"{direction}_rows", getattr(self, f"{direction}_rows") + sum(send_rows) - send_rows[me])
        for j, (n, link) in enumerate(zip(send_bytes, links)):
            if j != me:
                self.link_bytes[direction][link] += n


@dataclass
class ExpertLayout:
    """What :func:`~lightning_ciuic.parallel.experts.shard.shard_experts` made (see the module docstring): the layout's
    meshes (their expert views), the sharded modules and the dispatch's stats."""

    meshes: Meshes
    modules: dict[str, nn.Module]
    dispatch: DispatchCompression = "none"
    mode: DispatchMode = "flat"
    devices_per_node: Optional[int] = None  # None: the ep group on one node
    node_limit: Optional[int] = None  # the most nodes a token's router lets it reach (grouped routers; None: any)
    overlap: bool = False  # two chunks per call, one's all-to-alls in flight while the other computes (overlap.py)
    input_storage: DispatchCompression = "none"  # the experts' input rows kept for backward so encoded (storage.py)
    fp8: bool = False  # the experts' products by FP8 GEMMs (gemm_precision="fp8": parallel/fp8.py)
    stats: DispatchStats = field(default_factory=DispatchStats)
    codec: Optional[Codec] = field(init=False)
    input_codec: Optional[Codec] = field(init=False)
    grad_scale: float = field(init=False)
    tp_mesh: Optional[DeviceMesh] = field(init=False)
    clock: DeviceClock = field(init=False)
    nodes: ExpertNodes = field(init=False)
    hops: Optional[tuple[DeviceMesh, DeviceMesh]] = field(init=False)  # (inter-node, intra-node) meshes: hierarchical
    assume_balanced: bool = False  # route as if balanced, whatever the router chose (the planner's fake tensors)

    def __post_init__(self) -> None:
        self.clock = DeviceClock(torch.device(self.meshes.world.device_type))
        self.codec = dispatch_codec(self.dispatch)
        self.input_codec = dispatch_codec(self.input_storage, "expert_input_storage")
        self.grad_scale = expert_grad_scale(self.dims)
        self.tp_mesh = self.meshes.mesh(Axis.TP) if self.dims.ep_over_tp else None  # peers that split their tokens
        if self.mode not in DISPATCH_MODES:
            raise ValueError(f"expert_dispatch={self.mode!r}: use one of {list(DISPATCH_MODES)}.")
        self.nodes = expert_nodes(self.ep_mesh, self.devices_per_node)
        self.hops = self.nodes.hops(self.ep_mesh) if self.mode == "hierarchical" else None

    def hop_of(self, mesh: DeviceMesh, hop: Optional[str]) -> list[str]:
        """The link to each rank of ``mesh``: ``hop`` for one of the hierarchical dispatch's, else the ep group's."""
        return [hop] * mesh.size() if hop is not None else self.nodes.link

    @property
    def dims(self) -> ParallelDims:
        return self.meshes.dims

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks that exchange tokens."""
        return self.meshes.ep_mesh

    @property
    def data_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts, over which their gradients are averaged (and, sharded, split)."""
        return self.meshes.expert_data_mesh

    def keep_within(self, stages: Sequence[nn.Module]) -> None:
        """Forget the experts of pipeline stages this rank does not run (after the cut)."""
        here = {id(m) for stage in stages for m in stage.modules()}
        self.modules = {name: m for name, m in self.modules.items() if id(m) in here}

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules.values() for p in (module.gate_up_proj, module.down_proj)]

    def parameter_ids(self) -> set[int]:
        return {id(p) for p in self.parameters()}
