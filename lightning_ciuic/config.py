"""ParallelismConfig: every degree and option of a parallel layout, and every rule between them, in one place.

Contract: ``ParallelismConfig(...)`` validates on construction and raises ``ValueError`` / ``TypeError`` naming what
was given and what would work: each degree a positive integer (``data_parallel_size`` and
``data_parallel_shard_size`` may be ``"auto"``); ``weight_all_gather_compression`` only with sharding; sharded data
parallelism only with the codecs and schedules it supports; ``zero_stage`` (1, 2, 3 or ``None``:
:meth:`~lightning_ciuic.parallel.fsdp.ShardingConfig.stage_of`) only with ``data_parallel_shard_size > 1``, 1 and 2
not with ``fsdp_cpu_offload``, none with DiLoCo (``reshard_after_forward``, the older spelling, is stage 3 or 2); DiLoCo only with whole replicas and no per-step
compression; ``expert_parallel_size`` a positive integer dividing the innermost data-parallel degree (checked
against the world by ``resolve``), ``expert_dispatch_compression`` one of ``"none"``, ``"bf16"``, ``"fp8"``,
``"int8"`` and only with expert parallelism, ``expert_dispatch`` ``"flat"`` or ``"hierarchical"`` (only with expert
parallelism; the nodes from ``expert_devices_per_node``, a positive integer, ``None`` for the cluster environment's
devices per node, which the strategy fills in), ``expert_dispatch_overlap`` and ``expert_input_storage`` (one of
``expert_dispatch_compression``'s codecs) only with expert parallelism; per-step compression only on a process-group backend that has the
collectives it needs (``process_group_backend`` ``None``, ``"gloo"`` or ``"nccl"``); ``weight_all_gather_compression``
``"none"`` or ``"int8"``; ``gemm_precision`` ``None`` or ``"fp8"``, not with tensor parallelism;
``gradient_checkpointing`` one of the recomputation modes of :class:`~lightning_ciuic.parallel.recompute.Recompute` (kept as the parsed ``Recompute``). ``resolve(world_size)`` gives the :class:`~lightning_ciuic.parallel.dims.ParallelDims` (degrees against
the world: errors name every factor). The pieces are the configs of the parts that use them:
:class:`~lightning_ciuic.parallel.pipeline_module.PipelineConfig`, :class:`~lightning_ciuic.parallel.fsdp.ShardingConfig`,
:class:`~lightning_ciuic.comm.compression.CompressionConfig` and :class:`~lightning_ciuic.comm.diloco.DiLoCo`.
``HybridParallelStrategy`` keeps flat keyword arguments (its signature is the YAML schema) and packs them here once,
by name: :meth:`ParallelismConfig.from_strategy_args` (an unknown name is a ``TypeError``). ``check_devices(device_type)``
holds the rules between the arguments and the devices the run computes on (checked before any process starts), and
``with_precision(precision)`` is the one place Lightning's precision becomes FSDP2's dtypes.
:func:`~lightning_ciuic.parallel.parallelize.parallelize` and the planner read only this object; ``parallel/`` never
imports this module (the arrow runs one way: this module is above ``parallel/`` and ``comm/``).

``bucket_size_mb`` and ``sync_timeout`` (positive) are the replicated engine's gradient buckets and its collectives'
time limit, read with the rest by :func:`~lightning_ciuic.comm.engines.build_engine`.

No Lightning imports.
"""

from __future__ import annotations

from datetime import timedelta
from dataclasses import dataclass, field, replace

import torch
from typing import Any, Literal, Optional, Union

from lightning_ciuic.comm.compression import CompressionConfig
from lightning_ciuic.comm.diloco import DiLoCo
from lightning_ciuic.comm.grad_sync import check_bucket_size
from lightning_ciuic.comm.hooks import GradientQuantizer
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.experts import DISPATCH_COMPRESSIONS, DISPATCH_MODES, DispatchCompression, DispatchMode
from lightning_ciuic.parallel.fsdp import ShardingConfig, check_offload
from lightning_ciuic.parallel.pipeline import SPLIT_BACKWARD_SCHEDULES
from lightning_ciuic.parallel.pipeline_module import PipelineConfig
from lightning_ciuic.parallel.recompute import GradientCheckpointing, Recompute
from lightning_ciuic.validation import check_int

Degree = Union[int, Literal["auto"]]
SHARDED_REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # the reduce-scatter's dtype
MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # Lightning's precision -> compute dtype
SHARDED_CODECS = ("int8", "nf4")  # the reduce-scatter as a quantized all-to-all
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
COMPRESSION_BACKENDS = (None, "gloo", "nccl")  # all_to_all, all_gather_single and point-to-point sends
WEIGHT_CODECS = ("none", "int8")
GEMM_PRECISIONS = (None, "fp8")

# The strategy's flat keyword arguments -> (the piece of the config, its field there); "" is the config itself.
STRATEGY_ARGS: dict[str, tuple[str, str]] = {
    **{name: ("", name) for name in (
        "pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size", "data_parallel_shard_size",
        "expert_parallel_size", "expert_dispatch_compression", "expert_dispatch", "expert_devices_per_node",
        "expert_node_limit", "expert_dispatch_overlap", "expert_input_storage", "diloco", "gradient_checkpointing",
        "process_group_backend", "bucket_size_mb", "sync_timeout", "sequence_parallel", "gemm_precision",
    )},
    "pipeline_schedule": ("pipeline", "schedule"),
    "num_microbatches": ("pipeline", "num_microbatches"),
    "stages_per_rank": ("pipeline", "stages_per_rank"),
    "pipeline_split_points": ("pipeline", "split_points"),
    "max_deferred_weight_backwards": ("pipeline", "max_deferred_weight_backwards"),
    "fsdp_units": ("sharding", "units"),
    "zero_stage": ("sharding", "zero_stage"),
    "reshard_after_forward": ("sharding", "zero_stage"),  # the older spelling: True is zero_stage 3, False 2
    "fsdp_cpu_offload": ("sharding", "cpu_offload"),
    "weight_all_gather_compression": ("sharding", "weight_codec"),
    "communication_compression": ("compression", "mode"),
    "compression_ratio": ("compression", "compression_ratio"),
    "powersgd_rank": ("compression", "powersgd_rank"),
    "error_feedback": ("compression", "error_feedback"),
    "compression_warmup_steps": ("compression", "warmup_steps"),
    "allreduce_algorithm": ("compression", "algorithm"),
    "auto_recheck_steps": ("compression", "auto_recheck_steps"),
}
_PIECES = {"pipeline": PipelineConfig, "sharding": ShardingConfig, "compression": CompressionConfig}


def _zero_stage_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``reshard_after_forward`` (the older spelling, torchtitan's) as a ZeRO stage: ``True`` 3, ``False`` 2; given
    with a ``zero_stage`` that says otherwise, an error."""
    if "reshard_after_forward" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    reshard = kwargs.pop("reshard_after_forward")
    if reshard is None:
        return kwargs
    stage = 3 if reshard else 2
    given = kwargs.get("zero_stage")
    if given is not None and given != stage:
        raise ValueError(
            f"reshard_after_forward={bool(reshard)} is zero_stage={stage}, and zero_stage={given!r} was given too:"
            " give zero_stage alone (1, 2 or 3)."
        )
    return {**kwargs, "zero_stage": stage}


@dataclass(frozen=True)
class ParallelismConfig:
    """A parallel layout and its options (see the module docstring)."""

    pipeline_parallel_size: int = 1
    data_parallel_size: Degree = "auto"
    tensor_parallel_size: int = 1
    data_parallel_shard_size: Degree = 1
    expert_parallel_size: int = 1
    expert_dispatch_compression: DispatchCompression = "none"
    expert_dispatch: DispatchMode = "flat"  # "hierarchical": once per node over the inter-node link, fanned out inside
    expert_devices_per_node: Optional[int] = None  # the ep ranks' nodes (None: the cluster environment's, or one node)
    expert_node_limit: Optional[int] = None  # opt-in: each token's experts on at most this many nodes (routers by groups)
    expert_dispatch_overlap: bool = False  # two chunks per micro-batch: one chunk's all-to-alls run while the other computes
    # (and DualPipeV's forward-backward pairs interleaved: one micro-batch's while the other's)
    expert_input_storage: DispatchCompression = "none"  # the experts' input rows kept for backward in this encoding
    gemm_precision: Optional[str] = None  # "fp8": the blocks' linear layers and the ep experts by FP8 GEMMs (parallel/fp8.py)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    diloco: Optional[DiLoCo] = None
    gradient_checkpointing: Union[GradientCheckpointing, Recompute] = False  # parsed into a Recompute
    sequence_parallel: bool = True  # with tensor_parallel_size > 1: sequence and loss parallelism
    bucket_size_mb: float = 25.0  # the replicated engine's gradient buckets
    sync_timeout: float = 300.0  # seconds a gradient collective may take

    process_group_backend: Optional[str] = None  # None: gloo on CPU, NCCL on CUDA

    @classmethod
    def from_strategy_args(cls, **kwargs: Any) -> "ParallelismConfig":
        """The config of ``HybridParallelStrategy``'s flat keyword arguments (:data:`STRATEGY_ARGS`: each name to its
        piece and field), packed by name; what is not given keeps the piece's default. A
        :class:`~lightning_ciuic.comm.hooks.GradientQuantizer` as ``communication_compression`` gives its mode and
        error feedback; ``weight_all_gather_compression="none"`` is no codec; lists become tuples."""
        unknown = sorted(set(kwargs) - set(STRATEGY_ARGS))
        if unknown:
            raise TypeError(f"ParallelismConfig.from_strategy_args got unknown arguments {unknown}; it takes {sorted(STRATEGY_ARGS)}.")
        quantizer = kwargs.get("communication_compression")
        if isinstance(quantizer, GradientQuantizer):
            kwargs = {**kwargs, "communication_compression": quantizer.mode, "error_feedback": quantizer.error_feedback}
        if isinstance(kwargs.get("sync_timeout"), timedelta):
            kwargs = {**kwargs, "sync_timeout": kwargs["sync_timeout"].total_seconds()}
        kwargs = _zero_stage_of(kwargs)
        if kwargs.get("weight_all_gather_compression") == "none":
            kwargs = {**kwargs, "weight_all_gather_compression": None}
        pieces: dict[str, dict[str, Any]] = {"": {}, **{piece: {} for piece in _PIECES}}
        for name, value in kwargs.items():
            piece, attr = STRATEGY_ARGS[name]
            if isinstance(value, list):
                value = tuple(value)
            if attr in ("cpu_offload", "sequence_parallel"):
                value = bool(value)
            pieces[piece][attr] = value
        top = pieces.pop("")
        return cls(**top, **{piece: _PIECES[piece](**fields) for piece, fields in pieces.items()})

    def __post_init__(self) -> None:
        object.__setattr__(self, "gradient_checkpointing", Recompute.parse(self.gradient_checkpointing))
        ParallelDims.check_degrees(**self.degrees)
        self._check_choices()
        check_bucket_size(self.bucket_size_mb)
        if not self.sync_timeout > 0:
            raise ValueError(f"sync_timeout must be a positive number of seconds, got {self.sync_timeout!r} (the default is 300.0).")
        if self.sharding.weight_codec is not None and self.data_parallel_shard_size == 1:
            raise ValueError(
                f"weight_all_gather_compression={self.sharding.weight_codec!r} compresses the all-gather of sharded"
                " parameters, and data_parallel_shard_size=1 keeps whole replicas (nothing is gathered): set"
                " data_parallel_shard_size > 1, or leave it 'none'."
            )
        if self.diloco is not None:
            self._check_diloco()
        if self.sharding.zero_stage is not None:
            self._check_zero_stage()
        if self.data_parallel_shard_size != 1:
            self._check_sharded()
        self._check_experts()

    @property
    def degrees(self) -> dict[str, Any]:
        """The degrees as ``ParallelDims.resolve`` takes them."""
        return dict(
            pipeline_parallel_size=self.pipeline_parallel_size, data_parallel_size=self.data_parallel_size,
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_shard_size=self.data_parallel_shard_size,
            expert_parallel_size=self.expert_parallel_size,
        )

    def with_precision(self, precision: Optional[str]) -> "ParallelismConfig":
        """This config with FSDP2's dtypes for Lightning's ``precision`` (``"bf16-mixed"``, ``"16-mixed"``: parameters
        gathered in that dtype, gradients reduced in float32, or in the compression's 16-bit dtype) and the
        compression's codec for the sharded gradients."""
        param_dtype = MIXED_PRECISION_DTYPES.get(str(precision))
        mode = self.compression.mode
        reduce_dtype = SHARDED_REDUCE_DTYPES.get(mode, torch.float32 if param_dtype is not None else None)
        sharding = replace(
            self.sharding, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            gradient_codec=mode if mode in SHARDED_CODECS else None, error_feedback=self.compression.feedback_for(mode),
        )
        return replace(self, sharding=sharding)

    def with_devices_per_node(self, devices_per_node: int) -> "ParallelismConfig":
        """This config with ``expert_devices_per_node`` the cluster environment's ``devices_per_node`` unless given."""
        if self.expert_devices_per_node is not None:
            return self
        return replace(self, expert_devices_per_node=devices_per_node)

    def check_devices(self, device_type: str) -> None:
        """The rules between the arguments and the kind of device the ranks compute on (before any process starts)."""
        check_offload(self.sharding.cpu_offload, device_type)
        if self.process_group_backend == "nccl" and device_type != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs CUDA devices, but this run's devices are {device_type!r}; use 'gloo'."
            )

    def resolve(self, world_size: int) -> ParallelDims:
        """The degrees over ``world_size`` ranks, ``"auto"`` filled in; the pipeline schedule checked against ``pp``."""
        dims = ParallelDims.resolve(world_size, **self.degrees, experts_in_replica=self.diloco is not None)
        if dims.pp_enabled:
            self.pipeline.check_layout(dims.pp)
        return dims

    def _check_choices(self) -> None:
        backend, mode = self.process_group_backend, self.compression.mode
        if backend is not None and backend not in BACKENDS:
            raise ValueError(
                f"process_group_backend={backend!r} is not a torch.distributed backend;"
                f" use one of {BACKENDS} or None (gloo on CPU, NCCL on CUDA)."
            )
        if mode != "none" and backend not in COMPRESSION_BACKENDS:
            raise ValueError(
                f"communication_compression={mode!r} needs all_to_all, all_gather_single and"
                f" point-to-point sends, supported here on 'gloo' and 'nccl'; got process_group_backend="
                f"{backend!r}. Use 'gloo'/'nccl' or communication_compression='none'."
            )
        if self.gemm_precision not in GEMM_PRECISIONS:
            raise ValueError(
                f"gemm_precision={self.gemm_precision!r}: use None (the parameters' dtype) or 'fp8' (the blocks' linear"
                " layers and the expert-parallel experts by FP8 GEMMs, a scale per row: docs/fp8.md)."
            )
        if self.gemm_precision is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                f"gemm_precision={self.gemm_precision!r} with tensor_parallel_size={self.tensor_parallel_size}: the FP8"
                " GEMMs multiply whole local weights, and tensor parallelism makes them DTensors; use"
                " tensor_parallel_size=1 (DeepSeek-V3 trains without it), or leave gemm_precision None."
            )
        weight = self.sharding.weight_codec
        if weight is not None and weight not in WEIGHT_CODECS:
            raise ValueError(f"weight_all_gather_compression={weight!r} is not one of {', '.join(map(repr, WEIGHT_CODECS))}.")

    def _check_sharded(self) -> None:
        if self.pipeline_parallel_size > 1 and self.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES and self.sharding.zero_stage == 3:
            raise ValueError(
                f"pipeline_schedule={self.pipeline.schedule!r} splits backward into input- and weight-gradient passes,"
                " which gave wrong first-stage gradients with stages sharded by ZeRO-3 (FSDP2 gathering weights for"
                " each backward, torch 2.13) in our tests: with zero_stage=3 use 'gpipe', '1f1b', 'interleaved_1f1b' or"
                " 'looped_bfs', or keep the schedule with zero_stage=1 or 2 (the pipelines' default)."
            )
        mode = self.compression.mode
        if mode not in ("none", *SHARDED_REDUCE_DTYPES, *SHARDED_CODECS):
            raise ValueError(
                f"communication_compression={mode!r} does not apply to sharded data parallelism"
                f" (data_parallel_shard_size > 1), whose gradients are reduce-scattered by FSDP2: use 'none', 'fp16' or"
                f" 'bf16' (the reduce-scatter's dtype), 'int8' or 'nf4' (a quantized all-to-all), or"
                f" data_parallel_shard_size=1 for {mode!r}."
            )
        if self.compression.algorithm != "auto":
            raise ValueError(
                f"allreduce_algorithm={self.compression.algorithm!r} picks our ring/tree all-reduce, which sharded data"
                " parallelism does not use (FSDP2 reduce-scatters): leave it 'auto' with data_parallel_shard_size > 1."
            )

    def _check_zero_stage(self) -> None:
        stage = self.sharding.zero_stage
        if self.diloco is not None:
            raise ValueError(
                f"zero_stage={stage!r} with diloco: ZeRO shards the optimizer state (and gradients, weights) over the"
                " data-parallel ranks, and DiLoCo's replicas train apart, each with its whole optimizer: drop"
                " zero_stage (DiLoCo keeps whole replicas), or drop diloco and set data_parallel_shard_size > 1."
            )
        if self.data_parallel_shard_size == 1:
            raise ValueError(
                f"zero_stage={stage!r} shards the optimizer state over the sharded data-parallel ranks, and"
                " data_parallel_shard_size=1 keeps whole replicas: set data_parallel_shard_size > 1 (or 'auto'), or"
                " leave zero_stage unset."
            )
        if stage in (1, 2) and self.sharding.cpu_offload:
            raise ValueError(
                f"zero_stage={stage} keeps each unit's gathered weights on the GPU from the first forward of an"
                " optimizer step to its last backward, and fsdp_cpu_offload=True is for keeping them in host memory"
                " between uses: use zero_stage=3 (or leave it unset) with fsdp_cpu_offload, or drop the offload."
            )

    def _check_diloco(self) -> None:
        diloco = self.diloco
        if not isinstance(diloco, DiLoCo):
            raise TypeError(f"diloco must be a lightning_ciuic.DiLoCo(...), got {type(diloco).__name__}: {diloco!r}.")
        if self.compression.mode != "none":
            raise ValueError(
                f"communication_compression={self.compression.mode!r} compresses every step's gradient sync, which"
                f" DiLoCo does not run (replicas sync every {diloco.sync_every} steps): leave it 'none' and set"
                f" DiLoCo(compression=...) for the outer pseudo-gradients ('fp16', 'bf16', 'int8', 'nf4')."
            )
        if self.data_parallel_shard_size != 1:
            raise ValueError(
                f"diloco with data_parallel_shard_size={self.data_parallel_shard_size!r}: DiLoCo's workers are whole"
                " replicas (tensor or pipeline parallel inside each), not shards; use data_parallel_shard_size=1."
            )

    def _check_experts(self) -> None:
        dispatch = self.expert_dispatch_compression
        if dispatch not in DISPATCH_COMPRESSIONS:
            raise ValueError(
                f"expert_dispatch_compression={dispatch!r}: use one of {list(DISPATCH_COMPRESSIONS)} (how the tokens"
                " sent to the experts cross the all-to-all)."
            )
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if ep > 1 and self.diloco is not None and ep != tp:
            raise ValueError(
                f"expert_parallel_size={ep} with diloco: DiLoCo's data-parallel replicas train apart, so each"
                f" replica holds every expert, spread over its tensor-parallel peers: expert_parallel_size must"
                f" equal tensor_parallel_size={tp} (set both to the same degree), or drop diloco."
            )
        mode, per_node = self.expert_dispatch, self.expert_devices_per_node
        if mode not in DISPATCH_MODES:
            raise ValueError(
                f"expert_dispatch={mode!r}: use one of {list(DISPATCH_MODES)} ('hierarchical': a token crosses the"
                " inter-node link once per node, then fans out to its experts inside the node)."
            )
        if per_node is not None:
            check_int("expert_devices_per_node", per_node)
        if self.expert_node_limit is not None:
            check_int("expert_node_limit", self.expert_node_limit)
        storage = self.expert_input_storage
        if storage not in DISPATCH_COMPRESSIONS:
            raise ValueError(
                f"expert_input_storage={storage!r}: use one of {list(DISPATCH_COMPRESSIONS)} (how the experts keep their"
                " input rows for backward: 'fp8', DeepSeek-V3's, e4m3 with a scale per 128 values)."
            )
        if self.expert_parallel_size == 1:  # options of the expert-parallel dispatch, which then does not run
            for given, what, unset in (
                (self.expert_node_limit is not None, f"expert_node_limit={self.expert_node_limit} limits the nodes a"
                 " token's experts sit on, and expert_parallel_size=1 keeps every expert on every rank", "unset"),
                (self.expert_dispatch_overlap, "expert_dispatch_overlap=True runs one chunk's expert all-to-alls while"
                 " the other chunk computes, and expert_parallel_size=1 has no all-to-all to hide", "False"),
                (mode != "flat", f"expert_dispatch={mode!r} sends tokens to other ranks' experts, and"
                 " expert_parallel_size=1 sends none", "'flat'"),
                (storage != "none", f"expert_input_storage={storage!r} is how the expert-parallel experts keep their"
                 " input rows, and expert_parallel_size=1 leaves the model's own experts in place", "'none'"),
                (dispatch != "none", f"expert_dispatch_compression={dispatch!r} compresses the tokens sent to other"
                 " ranks' experts, and expert_parallel_size=1 sends none", "'none'"),
            ):
                if given:
                    raise ValueError(f"{what}: set expert_parallel_size > 1, or leave it {unset}.")
        recompute = self.gradient_checkpointing
        if storage != "none" and (recompute.mode == "selective" or (recompute.mode == "full" and recompute.every == 1)):
            raise ValueError(
                f"expert_input_storage={storage!r} with gradient_checkpointing={str(recompute)!r}: the blocks are"
                " recomputed, so the experts keep no input rows to encode; drop one, or recompute named modules"
                " ({'recompute': ['norm', 'mla_up']}) or every k-th block ('full:<k>')."
            )
