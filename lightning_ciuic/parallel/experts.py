"""Expert parallelism: each rank of the ``ep`` axis holds its share of every mixture-of-experts layer's experts, and
tokens travel to the rank that holds their expert and back.

Contract:

* **Packed experts** (:func:`packed_experts`): the modules this works on hold a layer's experts as two 3-D
  parameters, ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``, an
  ``act_fn``, and compute ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: each token
  the weighted sum of its ``k`` experts' SwiGLU outputs. transformers' DeepSeek-V3, Qwen3-MoE and Mixtral experts are
  such modules, and so is the pack's example model's. The router stays outside, replicated. :func:`packed_experts`
  finds them by their parameters' and ``act_fn``'s names and ranks (what the balance callbacks and the monitor count).
* :func:`shard_experts(module, meshes, dispatch)`: every packed-experts module's two parameters become DTensors
  ``Shard(0)`` over ``ep`` (global shapes: DCP checkpoints and Hugging Face loading keep working), rank ``j`` holding
  experts ``[j E/ep, (j+1) E/ep)``, and its forward becomes the expert-parallel one below. First, before any module
  is changed, each must have ``E % ep == 0`` and a forward known to compute what the expert-parallel one computes
  (:func:`~lightning_ciuic.parallel.expert_forward.check_takeover`: transformers' experts of that form, or a check
  of its own forward on a small input); any other is refused, naming it and the form that works.
  Returns an :class:`ExpertLayout` (``None`` if ``dims.ep == 1``); applying it twice changes nothing.
* **The forward** (:func:`expert_parallel_forward`): the ``T k`` (token, expert) pairs sorted by expert, the counts
  exchanged (one small all-to-all), the rows sent to their experts' ranks (``all_to_all_single``, uneven splits), the
  local experts run on what arrived (``torch._grouped_mm`` for float32/bf16/fp16 with 16-byte rows, else a loop over
  experts: float64), the results sent back, and each token's outputs summed with its routing weights, on the sender
  (the router's gradient stays local). A rank that receives no token still takes part in every collective. Backward
  runs the same exchanges in reverse, in the working precision. With ``ExpertLayout.assume_balanced`` (the planner's
  step on fake tensors, which hold no values), it routes as if every expert got an equal share of every rank's
  pairs, whatever the router chose: the sizes, collectives and allocations of a real step whose routing is balanced.
* **Over tensor-parallel peers** (``dims.ep_over_tp``: ``ep`` takes the tp peers too, which hold the same tokens):
  each peer dispatches its share of the tokens, and the shares' outputs are all-gathered; the inputs' gradients are
  summed over the peers (Megatron's copy-to-tensor-parallel-region), each peer keeps its share's output gradient.
* **Gradient scale**: an expert's gradient on its rank sums the contributions of every token its ``ep`` group
  routed to it, i.e. of ``dims.ep_data_ranks`` data-parallel ranks' batches. The forward scales it by
  ``1/ep_data_ranks`` on its way to the parameter, so the engines' mean over the ranks that hold the same experts
  (``edp``, and ``dp_replicate``: :meth:`ExpertLayout.data_mesh`) makes it the mean over all data-parallel ranks, as
  a dense gradient is.
* **Compressed dispatch** (``dispatch="bf16" | "fp8" | "int8"``): the rows going to the experts cross the
  all-to-all encoded (``fp8``: e4m3 codes, ``int8``: int8 codes, each with a float32 scale per 128 values; ``bf16``
  a cast), as DeepSeek-V3 dispatches in FP8; the results coming back and every gradient cross in the working
  precision. :class:`DispatchStats` counts the bytes each way, the rows this rank's experts computed and the seconds
  spent in the all-to-alls (counts, rows, results, gradients; a :class:`~lightning_ciuic.comm.timing.DeviceClock`:
  on a GPU, events on the stream). On the CPU each all-to-all is also a span on the process timeline's
  ``ep collectives`` track (the monitor's trace); a rank with fewer tokens waits there for busier ones.
* :class:`RoutedTokens(module)`: the tokens routed to each expert of each packed-experts module, counted as they enter
  it in training mode (with or without expert parallelism; not again when activation checkpointing recomputes a block
  in backward):
  what the load-balance callback and the monitor read.

No Lightning imports.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_ciuic import compat
from lightning_ciuic.wire.codecs import BlockFP8, BlockInt8, Codec, HalfPrecision
from lightning_ciuic.wire.timing import DeviceClock
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.dims import Meshes, ParallelDims
from lightning_ciuic.parallel.expert_forward import FORM, check_takeover, run_local_experts
from lightning_ciuic.parallel.tensor import sum_grad_over
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.timeline import timeline

DispatchCompression = Literal["none", "bf16", "fp8", "int8"]
DISPATCH_COMPRESSIONS = ("none", "bf16", "fp8", "int8")
DISPATCH_BLOCK = 128  # values per scale of the fp8/int8 dispatch (DeepSeek-V3's 1x128 activation tiles)


def dispatch_codec(name: str) -> Optional[Codec]:
    """The codec the dispatched rows cross the all-to-all with (``None``: their own dtype, exactly)."""
    codecs = {"none": None, "bf16": HalfPrecision(torch.bfloat16), "fp8": BlockFP8(DISPATCH_BLOCK), "int8": BlockInt8(DISPATCH_BLOCK)}
    if name not in codecs:
        raise ValueError(f"expert_dispatch_compression={name!r}: use one of {list(DISPATCH_COMPRESSIONS)}.")
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


@dataclass
class DispatchStats:
    """What the expert-parallel forwards of one layout moved (running totals)."""

    dispatch_bytes: int = 0  # sent by this rank to other ranks' experts (encoded)
    dispatch_rows: int = 0  # the rows (token, expert pairs) those bytes carried
    combine_bytes: int = 0  # results this rank sent back to the ranks that routed them
    combine_rows: int = 0
    received_tokens: int = 0  # rows this rank's experts computed
    seconds: float = 0.0  # in the token all-to-alls, forward and backward (waiting for the other ranks included)

    def add_seconds(self, seconds: float) -> None:
        self.seconds += seconds


class RoutedTokens:
    """Tokens this rank routed to each expert of each packed-experts module of ``module`` (see the module docstring).
    ``take()`` returns ``{module name: counts [E]}`` since the last call and starts again; ``remove()`` detaches."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = dict(packed_experts(module))
        self.counts: dict[str, torch.Tensor] = {}
        self._handles = [
            experts.register_forward_pre_hook(functools.partial(self._count, name), with_kwargs=True)
            for name, experts in self.modules.items()
        ]

    def _count(self, name: str, experts: nn.Module, args: tuple, kwargs: dict) -> None:
        if not experts.training or compat.in_backward():
            return  # evaluation; or a recompute, which routes the same tokens again
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        counts = torch.bincount(index.reshape(-1), minlength=experts.gate_up_proj.shape[0])
        previous = self.counts.get(name)
        self.counts[name] = counts if previous is None else previous + counts

    def take(self) -> dict[str, torch.Tensor]:
        counts, self.counts = self.counts, {}
        return counts

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class ExpertLayout:
    """What :func:`shard_experts` made: the layout's meshes (their expert views), the sharded modules and the dispatch's
    stats."""

    meshes: Meshes
    modules: dict[str, nn.Module]
    dispatch: DispatchCompression = "none"
    stats: DispatchStats = field(default_factory=DispatchStats)
    codec: Optional[Codec] = field(init=False)
    grad_scale: float = field(init=False)
    tp_mesh: Optional[DeviceMesh] = field(init=False)
    clock: DeviceClock = field(init=False)
    assume_balanced: bool = False  # route as if balanced, whatever the router chose (the planner's fake tensors)

    def __post_init__(self) -> None:
        self.clock = DeviceClock(torch.device(self.meshes.world.device_type))
        self.codec = dispatch_codec(self.dispatch)
        self.grad_scale = 1.0 / self.dims.ep_data_ranks  # see "Gradient scale" in the module docstring
        self.tp_mesh = self.meshes.mesh(Axis.TP) if self.dims.ep_over_tp else None  # peers that split their tokens

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


def shard_experts(module: nn.Module, meshes: Meshes, dispatch: DispatchCompression = "none") -> Optional[ExpertLayout]:
    """Shard every packed-experts module of ``module`` over ``ep`` (see the module docstring). The caller makes the
    data-parallel replicas equal first: each rank keeps its experts' rows of its own copy."""
    dims = meshes.dims
    if not dims.ep_enabled:
        return None
    found = packed_experts(module)
    if not found:
        raise ValueError(
            f"expert_parallel_size={dims.ep}, but {type(module).__name__} has no packed mixture-of-experts module."
            f" {FORM}. Give its experts that form, or use expert_parallel_size=1."
        )
    existing = getattr(found[0][1], "_expert_layout", None)
    if existing is not None:
        return existing  # applied already (Lightning sets a model up for each of fit, validate, test)
    verdicts: dict = {}  # a model's layers of one class and shape are checked once
    for name, experts in found:  # every module checked before any is changed
        _check_divisible(name, experts, dims.ep)
        check_takeover(name, experts, verdicts)
    layout = ExpertLayout(meshes, dict(found), dispatch)
    ep_mesh = layout.ep_mesh
    for name, experts in found:
        for attr in ("gate_up_proj", "down_proj"):
            param = getattr(experts, attr)
            setattr(experts, attr, nn.Parameter(_shard_rows(param.data, ep_mesh), requires_grad=param.requires_grad))
        experts._expert_layout = layout
        experts.forward = types.MethodType(expert_parallel_forward, experts)
    return layout


def _check_divisible(name: str, experts: nn.Module, ep: int) -> None:
    n = experts.gate_up_proj.shape[0]
    if n % ep:
        raise ValueError(
            f"{name} has {n} experts, which expert_parallel_size={ep} does not divide: use one of"
            f" {[d for d in range(1, n + 1) if n % d == 0]}."
        )


def _shard_rows(tensor: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    """``Shard(0)`` over ``ep_mesh`` without communication: every rank holds the whole tensor (or a meta one)."""
    if tensor.is_meta:
        rows = tensor.shape[0] // ep_mesh.size()
        local = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
        return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
    return distribute_tensor(tensor, ep_mesh, [Shard(0)], src_data_rank=None)


def all_to_all_timed(received: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int], layout: "ExpertLayout", name: str) -> torch.Tensor:
    """``all_to_all_single`` over the layout's ep group, timed into its stats (see the module docstring); every rank
    calls it, with or without anything to send."""
    clock = layout.clock
    start = clock.mark()
    dist.all_to_all_single(received, send, recv_splits, send_splits, group=layout.ep_mesh.get_group())
    end = clock.mark()
    clock.add(start, end, layout.stats.add_seconds)
    if not clock.cuda:  # host times are the collective's own on the CPU; on a GPU they would be its queueing
        timeline.record(f"ep {name}", Axis.EP, start, end, track="ep collectives")
    return received


def _all_to_all_bytes(send: torch.Tensor, send_bytes: list[int], recv_bytes: list[int], layout: "ExpertLayout", name: str) -> torch.Tensor:
    """Flat bytes exchanged with uneven splits."""
    return all_to_all_timed(send.new_empty(sum(recv_bytes)), send, recv_bytes, send_bytes, layout, name)


def _flat_bytes(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(-1).view(torch.uint8)


class _Exchange(torch.autograd.Function):
    """Rows to their ranks through an all-to-all (``send_rows[j]`` rows to rank ``j`` of the ep group): forward
    ``codec``-encoded, each destination's rows as one block-scaled piece (``None``: the rows' own bytes, exactly);
    backward the gradients' own bytes. Counts what left this rank in ``stats.<direction>_bytes`` / ``_rows``."""

    @staticmethod
    def forward(ctx, rows, send_rows, recv_rows, layout, codec, direction):  # type: ignore[override]
        ctx.send_rows, ctx.recv_rows, ctx.layout, ctx.direction = send_rows, recv_rows, layout, direction
        width, dtype = rows.shape[1], rows.dtype
        if codec is None:
            row_bytes = width * rows.element_size()
            send_bytes, recv_bytes = [n * row_bytes for n in send_rows], [n * row_bytes for n in recv_rows]
            payload = _flat_bytes(rows)
        else:
            send_bytes, recv_bytes = [codec.nbytes(n * width) for n in send_rows], [codec.nbytes(n * width) for n in recv_rows]
            payload = torch.cat([codec.encode(piece.reshape(-1).float()) for piece in rows.split(send_rows)])
        received = _all_to_all_bytes(payload, send_bytes, recv_bytes, layout, direction)
        stats, me = layout.stats, layout.ep_mesh.get_local_rank()
        setattr(stats, f"{direction}_bytes", getattr(stats, f"{direction}_bytes") + sum(send_bytes) - send_bytes[me])
        setattr(stats, f"{direction}_rows", getattr(stats, f"{direction}_rows") + sum(send_rows) - send_rows[me])
        if codec is None:
            return received.view(dtype).view(-1, width)
        pieces = [
            codec.decode(piece, n * width).view(n, width) for piece, n in zip(received.split(recv_bytes), recv_rows)
        ]
        return torch.cat(pieces).to(dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        width, row_bytes = grad.shape[1], grad.shape[1] * grad.element_size()
        send_bytes, recv_bytes = [n * row_bytes for n in ctx.recv_rows], [n * row_bytes for n in ctx.send_rows]
        back = _all_to_all_bytes(_flat_bytes(grad), send_bytes, recv_bytes, ctx.layout, f"{ctx.direction} gradient")
        return back.view(grad.dtype).view(-1, width), None, None, None, None, None


def expert_parallel_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The packed experts' forward under expert parallelism (bound to each sharded module; see the module docstring)."""
    layout: ExpertLayout = self._expert_layout
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


@dataclass(frozen=True)
class _Routing:
    """Where one rank's (token, expert) pairs go: rows to each rank of the ep group and rows from each, and, of what
    arrives, the expert of each row (grouped by source rank, then expert) and the rows of each local expert."""

    send_rows: list[int]
    recv_rows: list[int]
    expert_of_row: torch.Tensor
    per_local_expert: list[int]


def _routing(layout: ExpertLayout, flat: torch.Tensor, n_experts: int) -> _Routing:
    """The routing of the pairs ``flat`` (each one's expert), counted and exchanged (one small all-to-all)."""
    ep = layout.ep_mesh.size()
    local = n_experts // ep
    counts = torch.bincount(flat, minlength=n_experts)
    arriving = torch.empty_like(counts)
    all_to_all_timed(arriving, counts, [local] * ep, [local] * ep, layout, "counts")  # [source rank, local expert] tokens coming here
    arriving = arriving.view(ep, local)
    sizes = torch.cat([counts.view(ep, local).sum(1), arriving.sum(1), arriving.sum(0)]).tolist()  # one device sync
    send_rows, recv_rows = sizes[:ep], sizes[ep : 2 * ep]
    expert_of_row = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(
        arriving.reshape(-1), output_size=sum(recv_rows)
    )
    return _Routing(send_rows, recv_rows, expert_of_row, sizes[2 * ep :])


def _balanced_routing(layout: ExpertLayout, flat: torch.Tensor, n_experts: int) -> _Routing:
    """:func:`_routing` as if every rank of the ep group routed as many pairs as this one, spread evenly over the experts
    (expert ``e`` gets ``P // E`` of the ``P`` pairs, one more for ``e < P % E``), whatever their values: the counts
    exchanged, every size and every tensor allocated as a real balanced step's (``ExpertLayout.assume_balanced``)."""
    ep, me = layout.ep_mesh.size(), layout.ep_mesh.get_local_rank()
    local, pairs = n_experts // ep, flat.numel()
    counts = [pairs // n_experts + (1 if e < pairs % n_experts else 0) for e in range(n_experts)]
    exchanged = flat.new_empty(n_experts)
    all_to_all_timed(torch.empty_like(exchanged), exchanged, [local] * ep, [local] * ep, layout, "counts")
    mine = counts[me * local : (me + 1) * local]
    arrived = ep * sum(mine)
    expert_of_row = flat.new_empty(arrived)
    return _Routing(
        [sum(counts[j * local : (j + 1) * local]) for j in range(ep)], [sum(mine)] * ep, expert_of_row, [ep * n for n in mine],
    )


def _dispatch_and_combine(self, layout, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """Route, send, compute, send back, combine (see the module docstring)."""
    n_experts = self.gate_up_proj.shape[0]
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, so by destination rank
    source_token = order // k
    routing = (_balanced_routing if layout.assume_balanced else _routing)(layout, flat, n_experts)
    received = _Exchange.apply(
        hidden.index_select(0, source_token), routing.send_rows, routing.recv_rows, layout, layout.codec, "dispatch"
    )
    # what arrived is grouped by source rank, then expert; the experts want it grouped by expert
    by_expert = routing.expert_of_row.argsort(stable=True)
    computed = run_local_experts(self, received.index_select(0, by_expert), routing.per_local_expert, layout.grad_scale)
    layout.stats.received_tokens += computed.shape[0]
    unsorted = torch.empty_like(computed).index_copy(0, by_expert, computed)
    returned = _Exchange.apply(unsorted, routing.recv_rows, routing.send_rows, layout, None, "combine")
    weights = top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(returned.dtype)
    combined = hidden.new_zeros((tokens, returned.shape[1]), dtype=returned.dtype)
    return combined.index_add(0, source_token, returned * weights).to(hidden.dtype)
