"""Parallel degrees and the device mesh they define.

Contract: ``ParallelDims(pp, dp, tp, world_size)`` validates that every degree is a positive integer
(``dp`` may be ``"auto"``: whatever is left of the world once ``pp`` and ``tp`` are taken) and that
``pp * dp * tp == world_size``; errors name every factor and say what would work. ``dp_shard`` (default 1) of
the ``dp`` replicas shard the model between them (FSDP); ``dp_replicate = dp / dp_shard`` groups of them hold
replicas of the shards (HSDP); ``dp_shard`` must divide ``dp``. ``build_mesh`` returns a ``DeviceMesh`` with
``tp`` innermost so tensor-parallel peers are neighbouring ranks (the same node on a real cluster): the axes
``("pp", "dp", "tp")``, or, with ``dp_shard > 1``, ``("pp", "dp_replicate", "dp_shard", "tp")`` plus ``"dp"``,
the two data-parallel axes flattened (what samplers and replica-wide collectives use), and Lightning's
``ModelParallelStrategy`` names for the same axes (``data_parallel``, ``tensor_parallel``). ``ep`` (default 1) ranks
hold different experts of each mixture-of-experts layer (expert parallelism): they are carved from the innermost
data-parallel axis (``dp_shard`` when sharded, else ``dp``), as torchtitan's and DeepSpeed's are, and must divide it,
or be ``tp`` times a divisor of it (``ep`` then takes the tensor-parallel peers too: ``ep_over_tp``); with
``ep_in_replica`` (DiLoCo, whose data-parallel replicas train apart) the experts are spread over the tensor-parallel
peers of each replica alone (``ep`` equal to ``tp``);
:meth:`build_expert_mesh` gives the expert view of the same world, ``(pp, dp_replicate, edp, ep, tp)`` (sharded) or
``(pp, edp, ep, tp)``, where ``edp`` ranks hold the same experts. Axis names are
:class:`~lightning_ciuic.parallel.axes.Axis` members. Everything else asks this object ``pp_enabled``,
``dp_enabled``, ``tp_enabled``, ``sharded`` instead of comparing sizes itself, :meth:`ParallelDims.fsdp_mesh` for
the mesh FSDP2 shards over, and :meth:`ParallelDims.layout_key` for the identity of a rank's local state.

No Lightning imports: usable with plain ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ciuic import compat
from lightning_ciuic.parallel.axes import MESH_ALIASES, Axis
from lightning_ciuic.validation import check_int

MESH_AXES = (Axis.PP, Axis.DP, Axis.TP)
SHARDED_MESH_AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP)


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
        ep = expert_parallel_size
        if experts_in_replica and ep > 1:  # ep == tp: ParallelismConfig checks it when built
            return cls(pp=pp, dp=dp, tp=tp, world_size=world_size, dp_shard=data_parallel_shard_size, ep=ep, ep_in_replica=True)
        borrowed, axis = (data_parallel_shard_size, "data_parallel_shard_size") if data_parallel_shard_size > 1 else (dp, "data_parallel_size")
        if borrowed % ep != 0 and not (ep % tp == 0 and borrowed % (ep // tp) == 0):
            choices = sorted({*_divisors(borrowed), *(tp * d for d in _divisors(borrowed))})
            raise ValueError(
                f"expert_parallel_size={ep} must divide {axis}={borrowed} (pp={pp}, dp={dp}, dp_shard="
                f"{data_parallel_shard_size}, tp={tp}, world size {world_size}), or be tp={tp} times a divisor of it:"
                f" the expert-parallel ranks are data-parallel ranks (and their tensor-parallel peers) that hold"
                f" different experts. Use one of {choices}, or more data-parallel ranks."
            )
        return cls(pp=pp, dp=dp, tp=tp, world_size=world_size, dp_shard=data_parallel_shard_size, ep=ep)

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
        return self.ep_enabled and (self.ep_in_replica or (self.dp_shard if self.sharded else self.dp) % self.ep != 0)

    @property
    def ep_data_ranks(self) -> int:
        """Data-parallel ranks in one expert-parallel group (``ep``, or ``ep / tp`` when it includes the tp peers)."""
        return self.ep // self.tp if self.ep_over_tp else self.ep

    @property
    def edp(self) -> int:
        """Ranks of the innermost data-parallel axis that hold the same experts."""
        return (self.dp_shard if self.sharded else self.dp) // self.ep_data_ranks

    @property
    def sharded(self) -> bool:
        """Whether data-parallel ranks shard the model (FSDP / HSDP)."""
        return self.dp_shard > 1

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def dp_rank_of(self, global_rank: int) -> int:
        """The data-parallel index of ``global_rank`` in :meth:`build_mesh`'s row-major layout (tp innermost)."""
        return (global_rank // self.tp) % self.dp

    def layout_key(self) -> str:
        """The identity of a rank's local state: what its shards' shapes depend on (``pp``, ``tp``, ``dp_shard``), not
        the number of replicas, so an elastic change of ``dp_replicate`` keeps it. Checkpoints key per-rank state with
        it, snapshots record it, and a restore takes per-rank state only from the same key."""
        key = f"{Axis.PP}{self.pp}.{Axis.TP}{self.tp}.{Axis.DP_SHARD}{self.dp_shard}"
        return key + (f".{Axis.EP}{self.ep}" if self.ep_enabled else "")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the mesh over the initialized default process group (collective call); see the module docstring."""
        if not self.sharded:
            mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)
        else:
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=SHARDED_MESH_AXES)
            compat.flatten_mesh(mesh, (Axis.DP_REPLICATE, Axis.DP_SHARD), Axis.DP)
        for alias, axis in MESH_ALIASES.items():
            compat.flatten_mesh(mesh, (axis,), alias)
        return mesh

    def build_expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The expert view of ``mesh`` (collective call; same ranks, same root): the innermost data-parallel axis split
        into ``(edp, ep)``, ``ep`` innermost so expert-parallel peers are neighbouring ranks; when ``ep`` includes the
        tp peers (:attr:`ep_over_tp`), ``ep_dp``, that axis's part (``ep`` is ``ep_dp x tp``:
        :meth:`expert_parallel_mesh`)."""
        axis = Axis.DP_SHARD if self.sharded else Axis.DP
        if not self.ep_over_tp:
            return compat.unflatten_mesh(mesh, axis, (self.edp, self.ep), (Axis.EDP, Axis.EP))
        return compat.unflatten_mesh(mesh, axis, (self.edp, self.ep_data_ranks), (Axis.EDP, Axis.EP_DP))

    def expert_parallel_mesh(self, expert_mesh: DeviceMesh) -> DeviceMesh:
        """Of :meth:`build_expert_mesh`'s mesh, the ranks that exchange tokens (``ep``; ``ep_dp x tp`` flattened when
        ep includes the tp peers). Call once per expert mesh."""
        if not self.ep_over_tp:
            return expert_mesh[Axis.EP]
        return compat.flatten_mesh(expert_mesh, (Axis.EP_DP, Axis.TP), Axis.EP)

    def expert_data_mesh(self, expert_mesh: DeviceMesh) -> DeviceMesh:
        """Of :meth:`build_expert_mesh`'s mesh, the ranks holding the same experts: ``edp``, with ``dp_replicate``
        in front when sharded with replicas (HSDP for the experts)."""
        if self.sharded and self.dp_replicate > 1:
            return expert_mesh[Axis.DP_REPLICATE, Axis.EDP]
        return expert_mesh[Axis.EDP]

    def data_parallel_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh a data-parallel engine works on: ``"dp"`` (replicated) or :meth:`fsdp_mesh` (sharded)."""
        return self.fsdp_mesh(mesh) if self.sharded else mesh[Axis.DP]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``"dp_shard"`` (FSDP) or ``("dp_replicate", "dp_shard")`` (HSDP: FSDP2 shards
        on the last axis and replicates on the first)."""
        return mesh[Axis.DP_SHARD] if self.dp_replicate == 1 else mesh[Axis.DP_REPLICATE, Axis.DP_SHARD]

    def __str__(self) -> str:
        dp = f"dp={self.dp}" if not self.sharded else f"dp={self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard})"
        ranks = (
            "the tensor-parallel peers" if self.ep_in_replica
            else "the data-parallel ranks and their tp peers" if self.ep_over_tp else "the data-parallel ranks"
        )
        ep = f" x ep={self.ep} (of {ranks})" if self.ep_enabled else ""
        return f"pp={self.pp} x {dp} x tp={self.tp}{ep} (world size {self.world_size})"
