from datetime import timedelta

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_ciuic
from lightning_ciuic import HybridParallelStrategy


def test_registered_names():
    for name in ("ciuic", "ciuic_spawn", "ciuic_fork", "ciuic_forkserver"):
        assert name in StrategyRegistry
    trainer = Trainer(strategy="ciuic_spawn", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)
    assert trainer.strategy._start_method == "spawn"
    assert Trainer(strategy="ciuic", accelerator="cpu", devices=2, logger=False).strategy._start_method == "popen"


def test_seed_names_stay_importable():
    assert lightning_ciuic.HybridParallelEngine is HybridParallelStrategy
    assert lightning_ciuic.GradientSyncOptimizer is HybridParallelStrategy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1, got 0"),
        ({"pipeline_schedule": "zigzag"}, r"pipeline_schedule='zigzag' is not one of \['1f1b', 'dualpipev', 'gpipe'"),
        (
            {"pipeline_schedule": "interleaved_1f1b"},
            r"pipeline_schedule='interleaved_1f1b' interleaves several virtual stages per rank; set stages_per_rank >= 2",
        ),
        ({"pipeline_schedule": "1f1b", "stages_per_rank": 2}, r"'1f1b' runs one stage per rank, but stages_per_rank=2"),
        ({"pipeline_schedule": "zbv_zero_bubble", "stages_per_rank": 3}, r"places exactly 2 stages per rank in a V; got stages_per_rank=3"),
        ({"num_microbatches": 0}, "num_microbatches must be an integer >= 1, got 0"),
        ({"process_group_backend": "nccl2"}, r"process_group_backend='nccl2' is not a torch.distributed backend; use one of \('gloo', 'nccl'"),
        ({"start_method": "thread"}, "start_method='thread'; use 'popen', 'spawn', 'fork' or 'forkserver'"),
        ({"bucket_size_mb": 0}, r"bucket_size_mb must be > 0, got 0 \(25.0 is a good default\)"),
        ({"sync_timeout": -1}, "sync_timeout must be a positive number of seconds, got -1"),
        ({"timeout": timedelta(0)}, "timeout must be a positive number of seconds"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1 or 'auto', got 0"),
        ({"communication_compression": "int4"}, r"communication_compression='int4' is not a mode; use one of \('none', 'fp16'"),
        ({"communication_compression": "topk", "compression_ratio": 0}, r"compression_ratio must be in \(0, 1\], got 0"),
        ({"communication_compression": "topk", "compression_ratio": 1.01}, r"compression_ratio must be in \(0, 1\], got 1.01"),
        ({"communication_compression": "powersgd", "powersgd_rank": 0}, "powersgd_rank must be an integer >= 1 \\(4 is a common choice\\), got 0"),
        ({"allreduce_algorithm": "butterfly"}, r"allreduce_algorithm='butterfly'; use one of \('auto', 'ring', 'tree'\)"),
        (
            {"communication_compression": "int8", "allreduce_algorithm": "ring"},
            r"allreduce_algorithm='ring' applies to communication_compression in \('none', 'fp16', 'bf16'\) only; 'int8'",
        ),
        ({"communication_compression": "auto", "allreduce_algorithm": "tree"}, r"'auto' runs its own collective \(it may choose int8"),
        ({"compression_warmup_steps": -5}, "compression_warmup_steps must be an integer >= 0, got -5"),
        ({"communication_compression": "auto", "auto_recheck_steps": 0}, "auto_recheck_steps must be an integer >= 1, got 0"),
        (
            {"communication_compression": "int8", "process_group_backend": "mpi"},
            r"communication_compression='int8' needs all_to_all.*got process_group_backend='mpi'",
        ),
        ({"data_parallel_shard_size": 0}, "data_parallel_shard_size must be an integer >= 1 or 'auto', got 0"),
        (
            {"data_parallel_shard_size": 2, "communication_compression": "topk"},
            r"communication_compression='topk' does not apply to sharded data parallelism .* use 'none', 'fp16' or 'bf16'",
        ),
        (
            {"data_parallel_shard_size": 2, "allreduce_algorithm": "ring"},
            r"allreduce_algorithm='ring' picks our ring/tree all-reduce, which sharded data parallelism does not use",
        ),
        (
            {"data_parallel_shard_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "zbv_zero_bubble", "zero_stage": 3},
            r"pipeline_schedule='zbv_zero_bubble' splits backward .* use 'gpipe', '1f1b', 'interleaved_1f1b' or 'looped_bfs'",
        ),
        (
            {"weight_all_gather_compression": "int8"},
            r"weight_all_gather_compression='int8' compresses the all-gather of sharded parameters.* set data_parallel_shard_size > 1",
        ),
        (
            {"data_parallel_shard_size": 2, "weight_all_gather_compression": "fp8"},
            r"weight_all_gather_compression='fp8' is not one of 'none', 'int8'",
        ),
        ({"fsdp_units": []}, r"fsdp_units must be a non-empty list of module names .* got \[\]"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


def test_nccl_on_cpu_is_rejected_before_any_process_starts():
    strategy = HybridParallelStrategy(process_group_backend="nccl")
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' needs CUDA devices, but this run's devices are 'cpu'; use 'gloo'"):
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


def test_layout_that_cannot_fit_the_world_fails_before_processes_start():
    strategy = HybridParallelStrategy(tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by .* = 1 \* 4 = 4"):
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


@pytest.mark.parametrize(
    ("schedule", "pp", "stages"), [("dualpipev", 2, "pipeline_parallel_size 2 x 2 = 4"), ("1f1b", 4, "pipeline_parallel_size 4 = 4")]
)
def test_a_schedule_with_too_few_microbatches_fails_before_processes_start(schedule, pp, stages):
    """Said as the fix (more micro-batches, or GPipe), not as torch's "use batch sizes divisible by" at step 1."""
    strategy = HybridParallelStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule, num_microbatches=2)
    expected = rf"'{schedule}' needs at least as many micro-batches as stages: num_microbatches=2, stages = {stages}; use num_microbatches >= \d, or pipeline_schedule='gpipe'"
    with pytest.raises(ValueError, match=expected):
        Trainer(strategy=strategy, accelerator="cpu", devices=pp, logger=False)


def test_shard_size_that_does_not_divide_the_data_parallel_size_fails_before_processes_start():
    strategy = HybridParallelStrategy(data_parallel_shard_size=3)
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=3 must divide the data-parallel size 4 .* use one of \[1, 2, 4\]"):
        Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)


@pytest.mark.parametrize(
    "error_feedback, expected",
    [(None, {"fp16": False, "bf16": False, "int8": True, "nf4": True, "topk": True, "powersgd": True, "none": False}),
     (True, {"fp16": True, "bf16": True, "int8": True, "nf4": True, "topk": True, "powersgd": True, "none": False}),
     (False, {"fp16": False, "bf16": False, "int8": False, "nf4": False, "topk": False, "powersgd": False, "none": False})],
)
def test_error_feedback_is_opt_in_for_the_16_bit_casts_only(error_feedback, expected):
    config = HybridParallelStrategy(communication_compression="auto", error_feedback=error_feedback).parallelism.compression
    assert {mode: config.feedback_for(mode) for mode in expected} == expected



def test_every_precision_plugin_the_strategy_holds_clips_by_the_whole_models_norm():
    """The default plugin is made once and kept (Lightning's property would make a new one per read, unrouted); a
    plugin set later is routed too."""
    from lightning.pytorch.plugins.precision import Precision

    from lightning_ciuic.strategies.steps import clip_grad_by_global_norm

    strategy = HybridParallelStrategy()
    default = strategy.precision_plugin
    assert strategy.precision_plugin is default
    assert default.clip_grad_by_norm.func is clip_grad_by_global_norm and default.clip_grad_by_norm.args == (default, strategy)
    strategy.precision_plugin = given = Precision()
    assert strategy.precision_plugin is given and given.clip_grad_by_norm.args == (given, strategy)
