"""Parallel degrees and the device mesh they define.

Contract: ``ParallelDims(pp, dp, tp, world_size)`` validates that every degree is a positive integer
(``dp`` may be ``"auto"``: whatever is left of the world once ``pp`` and ``tp`` are taken) and that
``pp * dp * tp == world_size``; errors name every factor and say what would work. ``dp_shard`` (default 1) of
the ``dp`` replicas shard the model between them (FSDP); ``dp_replicate = dp / dp_shard`` groups of them hold
replicas of the shards (HSDP); ``dp_shard`` must divide ``dp``. ``ep`` (default 1) ranks hold different experts of
each mixture-of-experts layer (expert parallelism): they are carved from the innermost data-parallel axis
(:attr:`ParallelDims.inner_dp`, the one place that decides it: ``dp_shard`` when sharded, else ``dp``), as
torchtitan's and DeepSpeed's are, and must divide it, or be ``tp`` times a divisor of it (``ep`` then takes the
tensor-parallel peers too: ``ep_over_tp``); with ``ep_in_replica`` (DiLoCo, whose data-parallel replicas train apart)
the experts are spread over the tensor-parallel peers of each replica alone (``ep`` equal to ``tp``).

``build(device_type)`` (a collective call) builds the device mesh and every view of it once and returns them as
:class:`Meshes`, the one table of meshes: ``tp`` innermost so tensor-parallel peers are neighbouring ranks (the same
node on a real cluster); the axes ``("pp", "dp", "tp")``, or, with ``dp_shard > 1``, ``("pp", "dp_replicate",
"dp_shard", "tp")`` plus ``"dp"``, the two data-parallel axes flattened (what samplers and replica-wide collectives
use), and Lightning's ``ModelParallelStrategy`` names for the same axes (``data_parallel``, ``tensor_parallel``);
with experts, the expert view ``(pp, [dp_replicate,] edp, ep, tp)`` where ``edp`` ranks hold the same experts, and
its ``ep`` / ``edp`` views. Axis names are :class:`~lightning_ciuic.parallel.axes.Axis` members. Everything else asks
this object ``pp_enabled``, ``dp_enabled``, ``tp_enabled``, ``sharded`` instead of comparing sizes itself,
:meth:`ParallelDims.coordinates` for a rank's index on every axis (arithmetic, no process group), and
:meth:`ParallelDims.layout_key` for the identity of what a rank holds.

No Lightning imports: usable with plain ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, Optional, Union

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ciuic import compat
from lightning_ciuic.parallel.axes import MESH_ALIASES, Axis
from lightning_ciuic.validation import check_int

MESH_AXES = (Axis.PP, Axis.DP, Axis.TP)
SHARDED_MESH_AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP)
_ARGUMENTS = {Axis.DP: "data_parallel_size", Axis.DP_SHARD: "data_parallel_shard_size"}  # the degree's argument


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline (``pp``), data (``dp``, of which ``dp_shard`` shard the model) and tensor (``tp``)
    parallelism over ``world_size`` ranks."""

    pp: int
    dp: int
    tp: int
    world_size: int
    dp_shard: int = 1
    ep: int = 1
    ep_in_replica: bool = False  # the ep ranks are the tp peers of one data-parallel replica (see the docstring)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        tensor_parallel_size: int = 1,
        data_parallel_shard_size: Union[int, Literal["auto"]] = 1,
        expert_parallel_size: int = 1,
        experts_in_replica: bool = False,
    ) -> "ParallelDims":
        """Validate the degrees and fill in ``"auto"``: ``data_parallel_size`` from the world size,
        ``data_parallel_shard_size`` as the data-parallel size (plain FSDP over every data-parallel rank, whatever
        their number: what an elastic run needs)."""
        check_int("world_size", world_size)
        cls.check_degrees(
            pipeline_parallel_size, data_parallel_size, tensor_parallel_size, data_parallel_shard_size,
            expert_parallel_size,
        )
        pp, tp = pipeline_parallel_size, tensor_parallel_size
        model_parallel = pp * tp
        if data_parallel_size == "auto":
            if world_size % model_parallel != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by pipeline_parallel_size * tensor_parallel_size"
                    f" = {pp} * {tp} = {model_parallel}; with {world_size} processes choose pp * tp among"
                    f" {_divisors(world_size)}, or change the number of devices/nodes."
                )
            dp = world_size // model_parallel
        else:
            dp = int(data_parallel_size)
        if pp * dp * tp != world_size:
            fix = (
                f"data_parallel_size={world_size // model_parallel} (or 'auto') would work"
                if world_size % model_parallel == 0
                else f"pp * tp must also divide it (one of {_divisors(world_size)})"
            )
            raise ValueError(
                f"pipeline_parallel_size * data_parallel_size * tensor_parallel_size = {pp} * {dp} * {tp}"
                f" = {pp * dp * tp}, but the world size is {world_size}; the product must equal it: {fix}."
            )
        if data_parallel_shard_size == "auto":  # plain FSDP over every data-parallel rank; nothing to shard at dp=1
            data_parallel_shard_size = dp
        if dp % data_parallel_shard_size != 0:
            raise ValueError(
                f"data_parallel_shard_size={data_parallel_shard_size} must divide the data-parallel size {dp}"
                f" (pp={pp}, tp={tp}, world size {world_size}); use one of {_divisors(dp)}"
                f" ({dp} is plain FSDP, a smaller divisor is HSDP: replicas of sharded groups)."
            )
        dims = cls(pp=pp, dp=dp, tp=tp, world_size=world_size, dp_shard=data_parallel_shard_size, ep=expert_parallel_size)
        if experts_in_replica and dims.ep_enabled:  # ep == tp: ParallelismConfig checks it when built
            return replace(dims, ep_in_replica=True)
        ep, (axis, borrowed) = dims.ep, dims.inner_dp
        if borrowed % ep != 0 and not (ep % tp == 0 and borrowed % (ep // tp) == 0):
            choices = sorted({*_divisors(borrowed), *(tp * d for d in _divisors(borrowed))})
            raise ValueError(
                f"expert_parallel_size={ep} must divide {_ARGUMENTS[axis]}={borrowed} (pp={pp}, dp={dp}, dp_shard="
                f"{data_parallel_shard_size}, tp={tp}, world size {world_size}), or be tp={tp} times a divisor of it:"
                f" the expert-parallel ranks are data-parallel ranks (and their tensor-parallel peers) that hold"
                f" different experts. Use one of {choices}, or more data-parallel ranks."
            )
        return dims

    @staticmethod
    def check_degrees(
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        tensor_parallel_size: int = 1,
        data_parallel_shard_size: Union[int, Literal["auto"]] = 1,
        expert_parallel_size: int = 1,
    ) -> None:
        """Raise ``ValueError`` unless each degree is a positive integer (``dp`` and ``dp_shard`` may also be
        ``"auto"``)."""
        degrees = {
            "pipeline_parallel_size": pipeline_parallel_size,
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
            "data_parallel_shard_size": data_parallel_shard_size,
            "expert_parallel_size": expert_parallel_size,
        }
        for name, value in degrees.items():
            check_int(name, value, allowed=("auto",) if name in ("data_parallel_size", "data_parallel_shard_size") else ())

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_over_tp(self) -> bool:
        """Whether the expert-parallel ranks include the tensor-parallel peers (``ep`` does not divide the innermost
        data-parallel degree alone): each tp rank then dispatches its share of the tokens they all hold."""
        return self.ep_enabled and (self.ep_in_replica or self.inner_dp[1] % self.ep != 0)

    @property
    def ep_data_ranks(self) -> int:
        """Data-parallel ranks in one expert-parallel group (``ep``, or ``ep / tp`` when it includes the tp peers)."""
        return self.ep // self.tp if self.ep_over_tp else self.ep

    @property
    def edp(self) -> int:
        """Ranks of the innermost data-parallel axis that hold the same experts."""
        return self.inner_dp[1] // self.ep_data_ranks

    @property
    def sharded(self) -> bool:
        """Whether data-parallel ranks shard the model (FSDP / HSDP)."""
        return self.dp_shard > 1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def inner_dp(self) -> tuple[Axis, int]:
        """The innermost data-parallel axis and its degree: ``dp_shard`` when sharded, else ``dp``. The one place that
        decides it: expert parallelism is carved from it, and its index is what a sharded rank's shards depend on."""
        return (Axis.DP_SHARD, self.dp_shard) if self.sharded else (Axis.DP, self.dp)

    def coordinates(self, global_rank: int) -> dict[Axis, int]:
        """``global_rank``'s index on every axis of :meth:`build`'s meshes (row-major ``(pp, dp_replicate, dp_shard,
        tp)``, tp innermost; the expert view splits the innermost data-parallel axis into ``(edp, ep)``, ``ep``
        innermost, and flattens ``(ep_dp, tp)`` into ``ep`` when ep takes the tp peers). Pure arithmetic: the same
        indices the built meshes give that rank."""
        check_int("global_rank", global_rank, minimum=0)
        if global_rank >= self.world_size:
            raise ValueError(f"global_rank={global_rank} is outside the world of {self.world_size} ranks ({self}).")
        tp = global_rank % self.tp
        dp = (global_rank // self.tp) % self.dp
        coords = {
            Axis.PP: global_rank // (self.tp * self.dp), Axis.DP: dp, Axis.TP: tp,
            Axis.DP_REPLICATE: dp // self.dp_shard, Axis.DP_SHARD: dp % self.dp_shard,
        }
        if self.ep_enabled:
            inner = coords[self.inner_dp[0]]
            ep_dp = inner % self.ep_data_ranks
            coords[Axis.EDP] = inner // self.ep_data_ranks
            coords[Axis.EP_DP] = ep_dp
            coords[Axis.EP] = ep_dp * self.tp + tp if self.ep_over_tp else ep_dp
        return coords

    def dp_rank_of(self, global_rank: int) -> int:
        """The data-parallel index of ``global_rank`` (:meth:`coordinates`)."""
        return self.coordinates(global_rank)[Axis.DP]

    def layout_key(self, global_rank: int) -> str:
        """The identity of what ``global_rank`` holds: its index and degree on every axis that shapes its shards (the
        pipeline stage, the tensor-parallel rank, the ``dp_shard`` rank when sharded, the expert-parallel rank and which
        ranks are its expert peers: ``ep`` over the innermost data-parallel axis, ``x tp`` when it takes the tp peers
        too), and nothing else: not the data-parallel replica, so every rank that holds equal state has the same key,
        and an elastic change of ``dp_replicate`` (or of ``dp``, replicated) keeps it. Checkpoints key per-rank state
        with it, snapshots record it, and a restore takes a rank's state only from a holding of its key. Written
        ``pp0of2.tp1of2.dp_shard3of4.ep1of2-dp_shard2`` (``-dp2xtp2`` where ep takes the tp peers): no path separator,
        as it names checkpoint entries."""
        coords = self.coordinates(global_rank)
        parts = [f"{Axis.PP}{coords[Axis.PP]}of{self.pp}", f"{Axis.TP}{coords[Axis.TP]}of{self.tp}"]
        if self.sharded:
            parts.append(f"{Axis.DP_SHARD}{coords[Axis.DP_SHARD]}of{self.dp_shard}")
        if self.ep_enabled:
            peers = f"{self.inner_dp[0]}{self.ep_data_ranks}" + (f"x{Axis.TP}{self.tp}" if self.ep_over_tp else "")
            parts.append(f"{Axis.EP}{coords[Axis.EP]}of{self.ep}-{peers}")
        return ".".join(parts)

    def build(self, device_type: str) -> "Meshes":
        """The device mesh and every view of it, built once (collective call over the initialized default process
        group): see :class:`Meshes`."""
        if not self.sharded:
            world = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)
            views = {(Axis.DP,): world[Axis.DP]}
        else:
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
            world = init_device_mesh(device_type, shape, mesh_dim_names=SHARDED_MESH_AXES)
            views = {
                (Axis.DP,): compat.flatten_mesh(world, (Axis.DP_REPLICATE, Axis.DP_SHARD), Axis.DP),
                (Axis.DP_REPLICATE,): world[Axis.DP_REPLICATE],
                (Axis.DP_SHARD,): world[Axis.DP_SHARD],
                (Axis.DP_REPLICATE, Axis.DP_SHARD): world[Axis.DP_REPLICATE, Axis.DP_SHARD],
            }
        for alias, axis in MESH_ALIASES.items():
            compat.flatten_mesh(world, (axis,), alias)
        views[(Axis.PP,)], views[(Axis.TP,)] = world[Axis.PP], world[Axis.TP]
        expert = self._build_expert_views(world, views) if self.ep_enabled else None
        return Meshes(self, world, expert, views)

    def _build_expert_views(self, world: DeviceMesh, views: dict[tuple[Axis, ...], DeviceMesh]) -> DeviceMesh:
        """The expert view of ``world`` (same ranks, same root): the innermost data-parallel axis split into
        ``(edp, ep)``, ``ep`` innermost so expert-parallel peers are neighbouring ranks; when ep takes the tp peers
        (:attr:`ep_over_tp`), ``(edp, ep_dp)`` and ``ep`` the flattened ``(ep_dp, tp)``."""
        axis = self.inner_dp[0]
        if not self.ep_over_tp:
            expert = compat.unflatten_mesh(world, axis, (self.edp, self.ep), (Axis.EDP, Axis.EP))
            views[(Axis.EP,)] = expert[Axis.EP]
        else:
            expert = compat.unflatten_mesh(world, axis, (self.edp, self.ep_data_ranks), (Axis.EDP, Axis.EP_DP))
            views[(Axis.EP_DP,)] = expert[Axis.EP_DP]
            views[(Axis.EP,)] = compat.flatten_mesh(expert, (Axis.EP_DP, Axis.TP), Axis.EP)
        views[(Axis.EDP,)] = expert[Axis.EDP]
        if self.sharded and self.dp_replicate > 1:
            views[(Axis.DP_REPLICATE, Axis.EDP)] = expert[Axis.DP_REPLICATE, Axis.EDP]
        return expert

    def __str__(self) -> str:
        dp = f"dp={self.dp}" if not self.sharded else f"dp={self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard})"
        ranks = (
            "the tensor-parallel peers" if self.ep_in_replica
            else "the data-parallel ranks and their tp peers" if self.ep_over_tp else "the data-parallel ranks"
        )
        ep = f" x ep={self.ep} (of {ranks})" if self.ep_enabled else ""
        return f"pp={self.pp} x {dp} x tp={self.tp}{ep} (world size {self.world_size})"


@dataclass(frozen=True)
class Meshes:
    """One layout's device mesh and every view of it, built once by :meth:`ParallelDims.build` (the table everything
    asks for a mesh: nothing else slices, flattens or unflattens one).

    ``world``: ``(pp, dp, tp)`` or ``(pp, dp_replicate, dp_shard, tp)`` with ``dp`` flattened and Lightning's aliases;
    ``expert``: its expert view (``ep > 1``; else ``None``). :meth:`mesh` answers the views by their axes:
    ``mesh(Axis.PP)``, ``mesh(Axis.DP)``, ``mesh(Axis.TP)``; sharded also ``mesh(Axis.DP_REPLICATE)``,
    ``mesh(Axis.DP_SHARD)``, ``mesh(Axis.DP_REPLICATE, Axis.DP_SHARD)``; with experts ``mesh(Axis.EP)`` (the ranks
    that exchange tokens), ``mesh(Axis.EDP)`` (those holding the same experts), ``mesh(Axis.DP_REPLICATE, Axis.EDP)``
    (sharded with replicas) and ``mesh(Axis.EP_DP)`` (ep over the tp peers). The named properties are the views a
    part of the code works on."""

    dims: ParallelDims
    world: DeviceMesh
    expert: Optional[DeviceMesh]
    views: Mapping[tuple[Axis, ...], DeviceMesh]

    def mesh(self, *axes: Axis) -> DeviceMesh:
        """The view over ``axes`` (see the class docstring); a ``KeyError`` names the views this layout has."""
        key = tuple(Axis(axis) for axis in axes)
        if key not in self.views:
            have = ", ".join("(" + ", ".join(str(a) for a in k) + ")" for k in self.views)
            raise KeyError(f"no {key} view in the layout {self.dims}; it has {have}.")
        return self.views[key]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``dp_shard`` (FSDP) or ``(dp_replicate, dp_shard)`` (HSDP: FSDP2 shards on the
        last axis and replicates on the first). Sharded layouts only."""
        if self.dims.dp_replicate == 1:
            return self.mesh(Axis.DP_SHARD)
        return self.mesh(Axis.DP_REPLICATE, Axis.DP_SHARD)

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh a data-parallel engine works on: ``dp`` (replicated) or :attr:`fsdp_mesh` (sharded)."""
        return self.fsdp_mesh if self.dims.sharded else self.mesh(Axis.DP)

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks that exchange tokens (``ep``; ``ep_dp x tp`` flattened when ep takes the tp peers)."""
        return self.mesh(Axis.EP)

    @property
    def expert_data_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts: ``edp``, with ``dp_replicate`` in front when sharded with replicas
        (HSDP for the experts)."""
        if self.dims.sharded and self.dims.dp_replicate > 1:
            return self.mesh(Axis.DP_REPLICATE, Axis.EDP)
        return self.mesh(Axis.EDP)
