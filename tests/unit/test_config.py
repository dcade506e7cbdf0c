"""ParallelismConfig: the strategy's flat arguments packed by name, and every rule between arguments, each with its
message (the strategy's own construction errors are in test_strategy_args.py)."""

import inspect

import pytest
import torch

from lightning_ciuic import DiLoCo, HybridParallelStrategy
from lightning_ciuic.comm.hooks import GradientQuantizer
from lightning_ciuic.parallel.recompute import Recompute
from lightning_ciuic.config import STRATEGY_ARGS, ParallelismConfig


def test_every_flat_argument_lands_in_its_field_by_name():
    config = ParallelismConfig.from_strategy_args(
        pipeline_parallel_size=2, data_parallel_size=4, tensor_parallel_size=2, data_parallel_shard_size=2,
        pipeline_schedule="gpipe", num_microbatches=8, pipeline_split_points=["layers.2"],
        fsdp_units=["layers.0"], reshard_after_forward=False, weight_all_gather_compression="int8",
        communication_compression="bf16", compression_warmup_steps=3, process_group_backend="gloo",
        gradient_checkpointing=True,
    )
    assert config.degrees == dict(
        pipeline_parallel_size=2, data_parallel_size=4, tensor_parallel_size=2, data_parallel_shard_size=2,
        expert_parallel_size=1,
    )
    assert (config.pipeline.schedule, config.pipeline.num_microbatches, config.pipeline.split_points) == ("gpipe", 8, ("layers.2",))
    assert (config.sharding.units, config.sharding.zero_stage, config.sharding.weight_codec) == (("layers.0",), 2, "int8")
    assert (config.compression.mode, config.compression.warmup_steps) == ("bf16", 3)
    assert config.process_group_backend == "gloo" and config.gradient_checkpointing == Recompute.parse(True)
    assert ParallelismConfig.from_strategy_args() == ParallelismConfig()  # nothing given: every default
    assert ParallelismConfig.from_strategy_args(weight_all_gather_compression="none").sharding.weight_codec is None


def test_a_gradient_quantizer_gives_its_mode_and_error_feedback():
    config = ParallelismConfig.from_strategy_args(communication_compression=GradientQuantizer(bits=4, error_feedback=False))
    assert (config.compression.mode, config.compression.error_feedback) == ("nf4", False)


def test_an_unknown_argument_is_named():
    with pytest.raises(TypeError, match=r"unknown arguments \['bucket_sise_mb'\]; it takes \['allreduce_algorithm'"):
        ParallelismConfig.from_strategy_args(bucket_sise_mb=4)


def test_the_strategys_arguments_are_the_configs_by_the_same_names():
    """The strategy packs its arguments by these names: each must be one of its parameters, with the same default."""
    parameters = inspect.signature(HybridParallelStrategy.__init__).parameters
    assert set(STRATEGY_ARGS) <= set(parameters)
    defaults = {name: parameters[name].default for name in STRATEGY_ARGS}
    assert ParallelismConfig.from_strategy_args(**defaults) == ParallelismConfig()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"communication_compression": "int8", "process_group_backend": "ucc"},
            r"communication_compression='int8' needs all_to_all, all_gather_single and point-to-point sends, supported"
            r" here on 'gloo' and 'nccl'; got process_group_backend='ucc'. Use 'gloo'/'nccl' or communication_compression='none'",
        ),
        ({"process_group_backend": "nccl2"}, r"process_group_backend='nccl2' is not a torch.distributed backend; use one of \('gloo'"),
        ({"weight_all_gather_compression": "fp8"}, r"weight_all_gather_compression='fp8' is not one of 'none', 'int8'"),
        (
            {"weight_all_gather_compression": "int8"},
            r"weight_all_gather_compression='int8' compresses the all-gather of sharded parameters, and"
            r" data_parallel_shard_size=1 keeps whole replicas",
        ),
        (
            {"diloco": DiLoCo(), "communication_compression": "fp16"},
            r"communication_compression='fp16' compresses every step's gradient sync, which DiLoCo does not run",
        ),
        ({"expert_dispatch_compression": "fp8"}, r"expert_dispatch_compression='fp8' compresses the tokens .* expert_parallel_size=1 sends none"),
        (
            {"expert_dispatch_overlap": True},
            r"expert_dispatch_overlap=True runs one chunk's expert all-to-alls while the other chunk computes, and"
            r" expert_parallel_size=1 has no all-to-all to hide: set expert_parallel_size > 1, or leave it False",
        ),
        (
            {"expert_dispatch_compression": "fp4", "expert_parallel_size": 2},
            r"expert_dispatch_compression='fp4': use one of \['none', 'bf16', 'fp8', 'int8'\] \(how the tokens sent to the experts",
        ),
        (
            {"diloco": DiLoCo(), "data_parallel_size": 2, "expert_parallel_size": 2, "tensor_parallel_size": 1},
            r"expert_parallel_size=2 with diloco: .* must equal tensor_parallel_size=1 \(set both to the same degree\), or drop diloco",
        ),
        (
            {"diloco": DiLoCo(), "data_parallel_shard_size": 2},
            r"diloco with data_parallel_shard_size=2: DiLoCo's workers are whole replicas .* use data_parallel_shard_size=1",
        ),
        (
            {"data_parallel_shard_size": 2, "communication_compression": "powersgd"},
            r"communication_compression='powersgd' does not apply to sharded data parallelism .* or data_parallel_shard_size=1 for 'powersgd'",
        ),
        (
            {"data_parallel_shard_size": 2, "allreduce_algorithm": "tree"},
            r"allreduce_algorithm='tree' picks our ring/tree all-reduce, which sharded data parallelism does not use .* leave it 'auto'",
        ),
        (
            {"data_parallel_shard_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "dualpipev", "zero_stage": 3},
            r"pipeline_schedule='dualpipev' splits backward into input- and weight-gradient passes.* with zero_stage=3 use"
            r" 'gpipe', '1f1b', 'interleaved_1f1b' or 'looped_bfs', or keep the schedule with zero_stage=1 or 2",
        ),
        ({"gemm_precision": "fp16"}, r"gemm_precision='fp16': use None \(the parameters' dtype\) or 'fp8' \(the blocks' linear"),
        (
            {"gemm_precision": "fp8", "tensor_parallel_size": 2},
            r"gemm_precision='fp8' with tensor_parallel_size=2: the FP8 GEMMs multiply whole local weights.* use"
            r" tensor_parallel_size=1 \(DeepSeek-V3 trains without it\), or leave gemm_precision None",
        ),
    ],
)
def test_every_rule_between_arguments_says_what_was_given_and_what_works(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelismConfig.from_strategy_args(**kwargs)


def test_diloco_must_be_a_diloco_configuration():
    with pytest.raises(TypeError, match=r"diloco must be a lightning_ciuic.DiLoCo\(\.\.\.\), got dict: \{'sync_every': 4\}"):
        ParallelismConfig(diloco={"sync_every": 4})


def test_the_rules_between_arguments_and_devices():
    ParallelismConfig(process_group_backend="nccl").check_devices("cuda")
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' needs CUDA devices, but this run's devices are 'cpu'; use 'gloo'"):
        ParallelismConfig(process_group_backend="nccl").check_devices("cpu")
    with pytest.raises(ValueError, match=r"fsdp_cpu_offload=True keeps shards in host memory .* leave fsdp_cpu_offload=False"):
        ParallelismConfig.from_strategy_args(fsdp_cpu_offload=True, data_parallel_shard_size=2).check_devices("cpu")


def test_precision_is_resolved_in_one_place():
    config = ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, communication_compression="int8")
    mixed = config.with_precision("bf16-mixed").sharding
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.gradient_codec) == (torch.bfloat16, torch.float32, "int8")
    full = config.with_precision("32-true").sharding
    assert (full.param_dtype, full.reduce_dtype) == (None, None)


def test_zero_stage_and_its_older_spelling():
    """``zero_stage`` (1, 2, 3; ``None``: 3, and 2 under pipelines) and ``reshard_after_forward`` (3 / 2) land in
    ShardingConfig.zero_stage; the bad combinations are refused, saying what works."""
    assert ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, zero_stage=1).sharding.zero_stage == 1
    assert ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, reshard_after_forward=True).sharding.zero_stage == 3
    default = ParallelismConfig.from_strategy_args(data_parallel_shard_size=2).sharding
    assert (default.zero_stage, default.stage_of(pipelined=False), default.stage_of(pipelined=True)) == (None, 3, 2)
    offloaded = ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, fsdp_cpu_offload=True).sharding
    assert offloaded.stage_of(pipelined=True) == 3  # offload keeps ZeRO-3 under pipelines
    with pytest.raises(ValueError, match=r"reshard_after_forward=False is zero_stage=2, and zero_stage=3 was given too"):
        ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, reshard_after_forward=False, zero_stage=3)
    with pytest.raises(ValueError, match=r"zero_stage=4: use 1 .* 2 .* 3 .* or None"):
        ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, zero_stage=4)
    with pytest.raises(ValueError, match=r"zero_stage=1 .* data_parallel_shard_size=1 keeps whole replicas: set data_parallel_shard_size > 1"):
        ParallelismConfig.from_strategy_args(zero_stage=1)
    with pytest.raises(ValueError, match=r"zero_stage=2 keeps .* use zero_stage=3 \(or leave it unset\) with fsdp_cpu_offload"):
        ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, zero_stage=2, fsdp_cpu_offload=True)
    assert ParallelismConfig.from_strategy_args(data_parallel_shard_size=2, zero_stage=3, fsdp_cpu_offload=True).sharding.zero_stage == 3
    with pytest.raises(ValueError, match=r"zero_stage=1 with diloco: .* drop zero_stage"):
        ParallelismConfig.from_strategy_args(zero_stage=1, diloco=DiLoCo(sync_every=2))
