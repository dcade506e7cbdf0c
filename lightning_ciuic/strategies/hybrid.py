"""HybridParallelStrategy: Lightning glue for pipeline x data x tensor parallelism on one (pp, dp, tp) device mesh.

Contract:

* Arguments: flat keywords (the YAML schema), packed by name into one
  :class:`~lightning_ciuic.config.ParallelismConfig` (``self.parallelism``), where every rule between them lives.
  The strategy reads its options there only (``bucket_size_mb``, ``sync_timeout``, the compression, ...: no copies
  beside it). The class is Lightning's interface; the parts of the glue live in their own modules:
  :mod:`~lightning_ciuic.strategies.processes` (launcher, process group, meshes, teardown),
  :mod:`~lightning_ciuic.strategies.steps` (step routing, backward, loss parallelism, the precision plugin's clipping),
  :mod:`~lightning_ciuic.strategies.loaders` (loaders and the sampler's replicas),
  :mod:`~lightning_ciuic.strategies.collectives`, :mod:`~lightning_ciuic.strategies.checkpointing` (the state
  saved, checkpoints written, read and removed).
* Processes and the mesh: the strategy starts the process group (gloo on CPU, NCCL on CUDA unless
  ``process_group_backend`` says otherwise), builds the layout's meshes once (``ParallelDims.build``:
  ``self.meshes``, every view) and hands their ``world`` to
  the LightningModule as ``self.device_mesh`` before ``configure_model()`` runs (axes ``pp``, ``dp``, ``tp``, and
  ``ModelParallelStrategy``'s names ``data_parallel`` / ``tensor_parallel``). After it, set-up parallelizes the model
  with :func:`~lightning_ciuic.parallel.parallelize.parallelize` and nothing else: the module's
  ``tensor_parallel_plan(tp_mesh)`` (or what it applied itself), activation checkpointing, the pipeline cut, FSDP2
  units (or the module's own ``fully_shard`` units, then driven as sharded), materialisation of meta tensors.
  Where the LightningModule is itself an FSDP2 root, every step is routed through its ``forward``
  (:mod:`~lightning_ciuic.strategies.redirection`).
* Data parallel over the ``dp`` axis goes through one :class:`~lightning_ciuic.comm.data_parallel.DataParallel`
  engine (``self.data_parallel``, made by :func:`~lightning_ciuic.comm.engines.build_engine`: replicated, sharded
  with its ZeRO stage, or DiLoCo), driven at four points: set-up, the start of each step, ``no_sync`` for
  accumulation, after backward. ``comm/bytes_sent`` and ``comm/sync_time`` are logged every training step.
* Pipeline parallel (``pipeline_parallel_size > 1``): the module (a
  :class:`~lightning_ciuic.parallel.pipeline_module.PipelineModule`) is cut into stages over the ``pp`` axis; its
  steps run through the pipeline schedule, which does the backward itself (``pipeline/bubble`` logged).
* Loaders split data over the ``dp`` axis only; every ``pp`` and ``tp`` rank of a replica sees the same batch:
  Lightning's samplers by ``distributed_sampler_kwargs``, LitData's streaming datasets, the user's
  ``DistributedSampler`` s and iterable datasets with ``set_data_parallel(rank, size)`` pointed at the data-parallel
  world by :mod:`~lightning_ciuic.data.world`. On the first training step and after every restore the ranks of a
  replica compare a hash of their batch (:mod:`~lightning_ciuic.data.check`) and stop, saying why, where they differ.
* Gradient clipping by norm uses the global norm across tensor-parallel shards and pipeline stages.
* Checkpoints are ``torch.distributed.checkpoint`` directories any layout can load, or, with ``AsyncCheckpointer``
  / ``ChunkedCheckpointIO``, chunked, asynchronous, incremental checkpoints on any fsspec storage;
  ``Trainer.fit(ckpt_path=...)`` resumes exactly, also in another layout.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union, get_args

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_ciuic import compat
from lightning_ciuic.comm.compression import AllReduceAlgorithm, CompressionMode
from lightning_ciuic.comm.data_parallel import DataParallel
from lightning_ciuic.comm.diloco import DiLoCo
from lightning_ciuic.comm.engines import build_engine
from lightning_ciuic.comm.hooks import GradientQuantizer
from lightning_ciuic.config import STRATEGY_ARGS, ParallelismConfig
from lightning_ciuic.data.check import EqualBatchCheck
from lightning_ciuic.data.world import DataParallelWorld
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.dims import Meshes, ParallelDims
from lightning_ciuic.parallel.experts import DispatchCompression, DispatchMode
from lightning_ciuic.parallel.fsdp import has_meta_tensors
from lightning_ciuic.parallel.parallelize import Parallelized, parallelize
from lightning_ciuic.parallel.pipeline import PipelineRunner, PipelineScheduleName
from lightning_ciuic.parallel.recompute import GradientCheckpointing
from lightning_ciuic.parallel.shutdown import agree_on_setup, setup_vote_group
from lightning_ciuic.strategies import checkpointing, collectives, loaders, processes, restore_point, steps
from lightning_ciuic.validation import positive_seconds

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class HybridParallelStrategy(ParallelStrategy):
    """Pipeline x data x tensor parallelism with our own data-parallel gradient synchronizer.

    Args:
        tensor_parallel_size: ranks that shard each layer (``tp`` axis); the module gives its plan as
            ``tensor_parallel_plan(tp_mesh)`` (or applies it in ``configure_model()`` on ``self.device_mesh["tp"]``).
        sequence_parallel: under ``tensor_parallel_size > 1``, norms and residuals hold ``1/tp`` of the sequence and the
            LM head's logits stay vocabulary-sharded, the loss computed from the shards (docs/hybrid_parallel_strategy.md).
        data_parallel_size: model replicas (``dp`` axis); ``"auto"`` takes what is left of the world size.
        pipeline_parallel_size: pipeline stages (``pp`` axis); the module implements ``PipelineModule``.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or ``"dualpipev"`` (torch's schedules).
        num_microbatches: micro-batches each batch is cut into for the pipeline; must divide the batch size.
        stages_per_rank: virtual stages per rank (interleaved schedules need >= 2; V schedules use 2).
        max_deferred_weight_backwards: under the split-backward schedules (the zero-bubble ones, DualPipeV), at most
            this many weight backwards left pending on a rank, each run earlier where more would be: less memory at
            the schedule's end, a larger bubble (docs/pipeline.md). ``None``: the schedule's own order.
        gradient_checkpointing: activations recomputed in backward instead of kept: ``False``, ``True``/``"full"``
            (each block), ``"full:<k>"`` (every k-th block), ``"selective"`` (torchtitan's op-level policy) or
            ``{"recompute": ["norm", "mla_up", <sub-module patterns>]}`` (docs/hybrid_parallel_strategy.md).
        pipeline_split_points: names of the blocks where stages 2, 3, ... begin (default: balanced by
            parameter count).
        bucket_size_mb: size of each gradient bucket all-reduced as one collective.
        sync_timeout: seconds a gradient collective may take before the step fails with a clear error.
        process_group_backend: ``"gloo"``, ``"nccl"`` (``None``: gloo on CPU, NCCL on CUDA).
        start_method: ``"popen"`` re-runs the script per rank (like ``DDPStrategy``); ``"spawn"``/``"fork"``
            start processes with multiprocessing (notebooks, tests); ``"forkserver"`` forks them from a server
            that imported torch and Lightning once (a launch in a tenth of a second instead of seconds; the ranks get the
            caller's environment and random state, as with ``"spawn"``).
        timeout: seconds (or a ``timedelta``) for process-group set-up and non-gradient collectives.
        communication_compression: ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"nf4"``, ``"topk"``,
            ``"powersgd"`` or ``"auto"`` (chosen from measured bandwidth and codec speed, re-checked every
            ``auto_recheck_steps`` optimizer steps), or a ``GradientQuantizer(bits=...)``.
        compression_ratio: fraction of values ``"topk"`` keeps.
        powersgd_rank: rank of PowerSGD's approximation.
        error_feedback: add what compression dropped to the next step's gradient. ``None`` (default): for
            ``int8``, ``nf4``, ``topk`` and ``powersgd``, not for the 16-bit casts (their error is 2^-11 / 2^-8
            of each value); ``True``: for every lossy mode; ``False``: never.
        compression_warmup_steps: optimizer steps synchronized uncompressed before compression starts.
        allreduce_algorithm: ``"auto"`` (the backend's all-reduce), ``"ring"`` or ``"tree"`` (ours, for
            ``none``/``fp16``/``bf16``).
        data_parallel_shard_size: data-parallel ranks that shard parameters, gradients and optimizer state
            between them (FSDP2); ``1`` (default) keeps whole replicas, ``data_parallel_size`` (or ``"auto"``,
            which follows it, e.g. across elastic membership changes) is plain FSDP, a divisor in between is HSDP. ``communication_compression`` may then be ``"fp16"``/``"bf16"`` (the
            gradient reduce-scatter's dtype) or ``"int8"``/``"nf4"`` (a quantized all-to-all, ZeRO++'s qgZ).
        weight_all_gather_compression: ``"none"`` or ``"int8"`` (sharded only): the parameter all-gathers send
            block-wise int8 codes (ZeRO++'s qwZ); forward and backward compute with the decoded weights.
        fsdp_units: module names (as in ``named_modules()``) or classes sharded as one unit each (default:
            every block of the model's outermost ``nn.ModuleList`` s), then the root.
        zero_stage: with ``data_parallel_shard_size > 1``, what is sharded when (docs/hybrid_parallel_strategy.md):
            ``3`` gathers each unit's weights for every forward and backward (the least memory); ``2`` gathers a
            unit's (a pipeline stage's) weights once per optimizer step, across micro-batches and accumulation
            micro-steps, and reduce-scatters the gradients once per step; ``1`` as 2, the gradients held whole until
            the end of backward and reduce-scattered in one go (optimizer-state sharding, Megatron's distributed
            optimizer). ``None`` (default): 3, and 2 under pipeline parallelism without ``fsdp_cpu_offload``
            (torchtitan's default).
        reshard_after_forward: the older spelling of ``zero_stage``: ``True`` is 3, ``False`` 2; ``None`` (default)
            leaves it to ``zero_stage``.
        fsdp_cpu_offload: keep shards, gradients and optimizer state in host memory.
        diloco: a :class:`~lightning_ciuic.comm.diloco.DiLoCo` configuration: data-parallel replicas train alone
            and average their pseudo-gradients every ``sync_every`` steps through an outer Nesterov step
            (docs/diloco.md). It changes the optimisation: nothing turns it on but this argument.
        expert_parallel_size: data-parallel ranks (of ``data_parallel_shard_size`` when sharded, else of
            ``data_parallel_size``) that each hold a share of every mixture-of-experts layer's experts and send
            tokens to each other (docs/expert_parallel.md); the model's experts are packed (transformers' DeepSeek-V3,
            Qwen3-MoE, Mixtral, the example model). With ``diloco`` the experts are split over each replica's
            tensor-parallel peers instead: ``expert_parallel_size`` must equal ``tensor_parallel_size``.
        expert_dispatch_compression: ``"none"``, ``"bf16"``, ``"fp8"`` or ``"int8"``: how the tokens sent to the
            experts cross the all-to-all (fp8/int8 with a scale per 128 values); results and gradients return in
            the working precision.
        expert_dispatch: ``"flat"`` or ``"hierarchical"`` (a token crosses the inter-node link once per node and
            fans out inside it), ``expert_devices_per_node`` (``None``: the cluster environment's devices per
            node), ``expert_node_limit`` (opt-in: a token's experts on at most that many nodes),
            ``expert_dispatch_overlap`` (each micro-batch's tokens in two chunks, one chunk's all-to-alls in flight
            while the other's experts compute, forward and backward; under ``pipeline_schedule="dualpipev"`` its
            forward-backward pairs interleaved, one micro-batch's all-to-alls in flight while the other computes):
            docs/expert_parallel.md.
        expert_input_storage: ``"none"`` (the default), ``"fp8"``, ``"int8"`` or ``"bf16"``: the experts' input rows
            kept for backward in that encoding (DeepSeek-V3 keeps them in fp8: 0.52x of bf16's bytes); the experts'
            gate/up weight gradients then read the decoded rows (lossy, within the codec's rounding), nothing else
            changes. Not with ``gradient_checkpointing=True``, which keeps none: docs/expert_parallel.md.
        gemm_precision: ``None`` (the default: the parameters' dtype) or ``"fp8"``: every ``nn.Linear`` of the
            model's blocks (but mixture-of-experts routers) and, with expert parallelism, the routed experts multiply
            in FP8 (e4m3, a scale per token and per weight channel; weight gradients unquantized), as DeepSeek-V3
            trains. Lossy; not with tensor parallelism: docs/fp8.md.
    """

    strategy_name = "ciuic"
    announces_fit_restored = True  # calls restore_point.restore_done once fit's restore is over (strategies/restore_point.py)
    fit_start_step: Optional[int] = None  # the step the last fit started training from (after its restore)
    fit_end_step: Optional[int] = None  # where it ended, in a launching process whose ranks were spawned

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        pipeline_parallel_size: int = 1,
        pipeline_schedule: PipelineScheduleName = "1f1b",
        num_microbatches: int = 4,
        stages_per_rank: Optional[int] = None,
        max_deferred_weight_backwards: Optional[int] = None,
        gradient_checkpointing: GradientCheckpointing = False,
        pipeline_split_points: Optional[list[str]] = None,
        bucket_size_mb: float = 25.0,
        sync_timeout: float = 300.0,
        process_group_backend: Optional[str] = None,
        start_method: StartMethod = "popen",
        timeout: Union[float, timedelta] = 1800.0,
        communication_compression: Union[CompressionMode, GradientQuantizer] = "none",
        compression_ratio: float = 0.01,
        powersgd_rank: int = 4,
        error_feedback: bool | None = None,
        compression_warmup_steps: int = 0,
        allreduce_algorithm: AllReduceAlgorithm = "auto",
        auto_recheck_steps: int = 500,
        data_parallel_shard_size: Union[int, Literal["auto"]] = 1,
        fsdp_units: Optional[list[Union[str, type]]] = None,
        reshard_after_forward: Optional[bool] = None,
        zero_stage: Optional[Literal[1, 2, 3]] = None,
        fsdp_cpu_offload: bool = False,
        weight_all_gather_compression: Literal["none", "int8"] = "none",
        diloco: Optional[DiLoCo] = None,
        expert_parallel_size: int = 1,
        expert_dispatch_compression: DispatchCompression = "none",
        expert_dispatch: DispatchMode = "flat",
        expert_devices_per_node: Optional[int] = None,
        expert_node_limit: Optional[int] = None,
        expert_dispatch_overlap: bool = False,
        expert_input_storage: DispatchCompression = "none",
        gemm_precision: Optional[Literal["fp8"]] = None,
        sequence_parallel: bool = True,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in get_args(StartMethod):
            raise ValueError(f"start_method={start_method!r}; use 'popen', 'spawn', 'fork' or 'forkserver'.")
        # The flat arguments (the YAML schema), packed once by name: every rule between them lives in ParallelismConfig,
        # the one place the strategy, its glue modules and the planner read them from.
        arguments = locals()
        self.parallelism = ParallelismConfig.from_strategy_args(**{name: arguments[name] for name in STRATEGY_ARGS})
        self.pipeline: Optional[PipelineRunner] = None
        self.parallelized: Optional[Parallelized] = None
        self.told_how_to_read = False  # a sharded checkpoint directory was written and how to read it said (once)
        self._pipeline_grads: list[Optional[torch.Tensor]] = []
        self.data_parallel: Optional[DataParallel] = None  # the engine, once the processes and the model exist
        self.batch_check = EqualBatchCheck()  # the replica's ranks compare their batches (data/check.py)
        self._logged = (0, 0.0)
        self._timeout = positive_seconds("timeout", timeout)  # process-group set-up and non-gradient collectives
        self._start_method = start_method
        self._created_process_group = False  # by this strategy, in this process (strategies/processes.py)
        self.num_nodes = 1
        self.parallel_dims: Optional[ParallelDims] = None
        self.meshes: Optional[Meshes] = None  # the layout's meshes, built once per process (strategies/processes.py)

    # -- processes and the mesh --------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        if self.meshes is None:
            raise RuntimeError("The device mesh exists once the processes are set up (in configure_model and later).")
        return self.meshes.world

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self.parallelism.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector: inject distributed samplers for this strategy."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel replicas and this rank's index among them (:func:`~lightning_ciuic.strategies.loaders.sampler_kwargs`)."""
        return loaders.sampler_kwargs(self)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        processes.configure_launcher(self)

    def set_world_ranks(self) -> None:
        processes.set_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        processes.start(self)

    @override
    def setup(self, trainer: Trainer) -> None:
        # Every rank ends its set-up at the same vote, failed or not: a failure is reported once, by the lowest rank
        # that had it, and the others stop quietly (lightning_ciuic.parallel.shutdown.agree_on_setup).
        failure: Optional[Exception] = None
        try:
            assert self.model is not None and self.accelerator is not None
            self.accelerator.setup(trainer)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self._parallelize()
            self._setup_data_parallel()
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
                if self.data_parallel is not None:
                    self.data_parallel.track_optimizers([compat.unwrap_optimizer(o) for o in self.optimizers])
            self.setup_precision_plugin()
        except Exception as error:
            failure = error
        agree_on_setup(failure, setup_vote_group(self._timeout))
        self.barrier("setup")

    def _parallelize(self) -> None:
        """The model becomes this rank's part of the layout: :func:`~lightning_ciuic.parallel.parallelize.parallelize`
        and nothing else (tensor parallel, activation checkpointing, pipeline cut, FSDP2 units, materialisation). Once
        per module: Lightning sets the same model up again for validate or test after fit, in the same process (the
        ranks ``"popen"`` starts), and parallelizing it again would treat its shards as whole tensors (broadcasting one
        rank's experts over the others, taking the strategy's own FSDP2 units for a user's)."""
        assert self.parallel_dims is not None and self.meshes is not None and self.model is not None
        earlier = self.parallelized
        if earlier is not None and earlier.module is self.model and earlier.dims == self.parallel_dims:
            self.pipeline = earlier.pipeline
            return
        if compat.layer_sync(self) is not None and self.parallel_dims.dp_enabled:  # Trainer(sync_batchnorm=True)
            # Statistics over the data-parallel replicas' batches: tp and pp peers hold the same or other layers.
            dp_group = self.meshes.mesh(Axis.DP).get_group()
            self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model, process_group=dp_group)
        config = self._config_for_precision()
        self.parallelized = parallelize(self.model, self.meshes, config)
        self.pipeline = self.parallelized.pipeline
        if self.pipeline is not None:
            pipeline = config.pipeline
            limit = pipeline.max_deferred_weight_backwards
            deferred = "" if limit is None else f", at most {limit} weight backwards deferred"
            rank_zero_info(f"HybridParallelStrategy: {pipeline.schedule} pipeline, {pipeline.num_microbatches} micro-batches{deferred}")
        if self.parallelized.user_sharded:
            rank_zero_info(
                f"HybridParallelStrategy: {type(self.model).__name__} shards itself (fully_shard in configure_model):"
                " its FSDP2 units synchronise the data-parallel gradients."
            )

    def _setup_data_parallel(self) -> None:
        self._close_data_parallel()
        self._logged = (0, 0.0)
        assert self.parallelized is not None
        self.data_parallel = build_engine(self.parallelized, self._config_for_precision())

    def _config_for_precision(self) -> ParallelismConfig:
        """The config with FSDP2's dtypes for the precision plugin's precision (:meth:`ParallelismConfig.with_precision`,
        the one place that decides them)."""
        config = self.parallelism.with_precision(getattr(self.precision_plugin, "precision", None))
        return config.with_devices_per_node(max(1, self.num_processes))  # the cluster environment's: the ep ranks' nodes

    def _close_data_parallel(self) -> None:
        if self.data_parallel is not None:
            self.data_parallel.close()
        self.data_parallel = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return steps.training_step(self, super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return steps.evaluation_step(self, super().validation_step, "validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return steps.evaluation_step(self, super().test_step, "test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return steps.evaluation_step(self, super().predict_step, "predict_step", *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.data_parallel is not None:
            self.data_parallel.after_optimizer_step()
        return output

    @override
    def on_train_end(self) -> None:
        if self.data_parallel is not None:
            self.data_parallel.finish()
        super().on_train_end()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        compat.reset_optimizers_and_schedulers(self)
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if has_meta_tensors(self.model):
            return  # materialised by parallelize(), shard by shard where sharded
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)`` builds the model on the meta device: nothing is allocated until
        :func:`~lightning_ciuic.parallel.parallelize.parallelize` materialises it, after sharding where the model is
        sharded (each rank then allocates only its shards). Otherwise Lightning's behaviour."""
        if empty_init:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    # -- gradient synchronization ------------------------------------------------------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.data_parallel is None:
            yield
            return
        with self.data_parallel.no_sync():
            yield

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return steps.backward(self, super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.data_parallel is not None:
            # the pipeline schedule's backward passes ran with sync off: their gradients are accumulated
            self.data_parallel.after_backward(accumulated=self.pipeline is not None)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return loaders.process_dataloader(self, dataloader)

    @property
    def data_parallel_world(self) -> DataParallelWorld:
        """This rank's data-parallel rank and size: what every loader must split its data by."""
        kwargs = self.distributed_sampler_kwargs
        return DataParallelWorld(kwargs["rank"], kwargs["num_replicas"])

    @property
    @override
    def precision_plugin(self) -> Precision:
        return steps.precision_plugin(self)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        steps.set_precision_plugin(self, plugin)  # its norm clipping over the whole model

    # -- collectives -------------------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier(self.root_device)
        if name == compat.RESTORE_DONE_BARRIER:
            restore_point.restore_done(self.lightning_module.trainer)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[torch.Tensor, Any]:
        """Reduce over ``group`` (default: all ranks). Values are equal across ``tp`` ranks, so the mean
        over all ranks equals the mean over data-parallel replicas."""
        return collectives.reduce(tensor, group, reduce_op)

    # -- checkpoints (strategies/checkpointing.py) ------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpointing.model_state(self)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return checkpointing.optimizer_state(self, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in place by load_checkpoint()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in place by load_checkpoint()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        checkpointing.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def on_train_start(self) -> None:
        loaders.continue_where_the_loader_resumed(self.lightning_module.trainer)  # a resume into another dp size

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return checkpointing.load_checkpoint(self, checkpoint_path)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        checkpointing.remove_checkpoint(self, filepath)

    @override
    def teardown(self) -> None:
        processes.teardown(self, super().teardown)
