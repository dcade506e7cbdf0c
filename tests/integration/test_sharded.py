"""Sharded data parallelism (FSDP2 over dp_shard, HSDP with dp_replicate) trains to the same parameters as one
process (float64, tolerance from the numerics: tests/helpers.rounding_atol)."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy, compat
from lightning_ciuic.tensors import local_tensor
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH = 4, 2
MOE_MODEL = {**TINY_MODEL, "n_routed_experts": 4}  # ep 2 divides its experts


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**TINY_MODEL).double()


def _tiny_moe() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**MOE_MODEL).double()


def _parts(tensor: torch.Tensor, axis: str) -> int:
    """Into how many parts mesh axis ``axis`` cuts ``tensor`` (1: not cut, or not a DTensor on that axis)."""
    names = tensor.device_mesh.mesh_dim_names if isinstance(tensor, DTensor) else None
    if not names or axis not in names:
        return 1
    i = names.index(axis)
    return 1 if tensor.placements[i].is_replicate() else tensor.device_mesh.size(i)


class ShardSizes(Callback):
    """Rank 0's parameter and AdamW-state values held locally, in ``callback_metrics``: what it holds, what it would
    hold with tensor parallelism alone, and how many parameters the data-parallel shard axis leaves whole."""

    def on_train_end(self, trainer, pl_module):
        params = list(pl_module.parameters())
        state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0]
        trainer.callback_metrics.update({
            "sizes/local_params": torch.tensor(float(sum(local_tensor(p).numel() for p in params))),
            "sizes/tp_local_params": torch.tensor(float(sum(p.numel() / _parts(p, "tp") for p in params))),
            "sizes/whole_over_dp_shard": torch.tensor(float(sum(_parts(p, "dp_shard") == 1 for p in params))),
            "sizes/local_state": torch.tensor(float(sum(local_tensor(t).numel() for t in state))),
        })


class CollectiveCounts(Callback):
    """Rank 0's sharded engine: the all-gathers and reduce-scatters of the last optimizer step (the first also
    gathers for the pipeline's shape inference), and its FSDP2 units that own parameters (roots included)."""

    def __init__(self) -> None:
        self.before = (0, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.data_parallel.stats
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and trainer.global_step < trainer.max_steps:
            self.before = (stats.gathers, stats.scatters)  # at the end of every optimizer step but the last

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.data_parallel
        trainer.callback_metrics.update({
            "counts/gathers": torch.tensor(float(engine.stats.gathers - self.before[0])),
            "counts/scatters": torch.tensor(float(engine.stats.scatters - self.before[1])),
            "counts/units": torch.tensor(float(sum(n > 0 for n in engine._unit_numel))),
            "counts/stage": torch.tensor(float(engine.stage)),
        })


@pytest.mark.parametrize(
    "dp, shard, tp, pp, ep, accumulate, clip, zero, schedule",
    [
        (2, 2, 2, 1, 1, 1, 0.05, None, "1f1b"), (4, 2, 1, 1, 1, 1, 0.05, 2, "1f1b"), (2, 2, 1, 2, 1, 2, 0.05, 3, "1f1b"),
        (2, 2, 1, 2, 2, 2, 0.05, None, "1f1b"), (2, 2, 1, 2, 2, 2, 0.05, 1, "1f1b"), (4, 4, 1, 1, 2, 2, 0.05, 1, "1f1b"),
        (4, 4, 1, 1, 2, 2, 0.05, 2, "1f1b"), (2, 2, 1, 2, 2, 2, 0.05, 1, "dualpipev"),
        (2, 2, 1, 2, 1, 2, 0.05, None, "zbv_zero_bubble"),
    ],  # FSDP 2 without accumulation: the meta test; FSDP 4 with ep 2: the experts sharded over 2 ranks too
    ids=[
        "fsdp2xtp2-clip", "hsdp2x2-clip-zero2", "fsdp2xpp2-accumulate2-clip-zero3", "fsdp2xpp2-ep2-accumulate2-zero2",
        "fsdp2xpp2-ep2-accumulate2-zero1", "fsdp4-ep2-accumulate2-zero1", "fsdp4-ep2-accumulate2-zero2",
        "fsdp2xpp2-ep2-dualpipev-accumulate2-zero1", "fsdp2xpp2-zbv-accumulate2-zero2",
    ],
)
def test_sharded_layout_matches_single_process(dp, shard, tp, pp, ep, accumulate, clip, zero, schedule):
    """Each ZeRO stage (zero_stage; None: 3, and 2 under pipelines) with pipelines and accumulation, the experts
    sharded too. ZeRO-1/2 gather each unit's weights once per optimizer step and reduce-scatter its gradients once,
    across micro-batches and accumulation micro-steps; ZeRO-3 gathers them for every forward and backward. The
    schedules that split backward into input and weight passes (DualPipeV, DeepSeek-V3's, and ZB-V: 4 micro-batches,
    one per stage) run under ZeRO-1/2 (ZeRO-3 gave the first stage wrong gradients with them, and is refused)."""
    microbatches = 4 if schedule in ("dualpipev", "zbv_zero_bubble") else 2
    strategy = HybridParallelStrategy(
        data_parallel_size=dp, data_parallel_shard_size=shard, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        expert_parallel_size=ep, num_microbatches=microbatches, pipeline_schedule=schedule, zero_stage=zero,
        start_method="forkserver",
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dp * tp * pp, max_steps=STEPS, logger=False, gradient_clip_val=clip,
        accumulate_grad_batches=accumulate, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, precision=PRECISION, callbacks=[ShardSizes(), CollectiveCounts()],
    )
    factory = _tiny_moe if ep > 1 else _tiny
    module = factory()
    per_rank = max(PER_RANK_BATCH, microbatches)
    global_batch = per_rank * dp * accumulate
    trainer.fit(module, loader(STEPS * global_batch, per_rank))
    actual = {k: v.detach() for k, v in module.state_dict().items()}
    assert_state_close(actual, reference_training(factory, STEPS, global_batch, clip=clip), STEPS)
    sizes = {k.split("/")[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("sizes/")}
    # Every parameter is cut over dp_shard: a rank holds 1/shard of what tensor parallelism alone leaves it (dim-0
    # shards: a few rows of padding at most), and AdamW's two moments for that share only.
    assert ep > 1 or sizes["whole_over_dp_shard"] == 0, sizes  # (the experts: cut over ep x their own data axis)
    share = sizes["tp_local_params"] / shard
    assert share <= sizes["local_params"] <= 1.1 * share, sizes
    assert sizes["local_state"] == 2 * sizes["local_params"], sizes
    counts = {k.split("/")[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("counts/")}
    assert counts["stage"] == (zero or (2 if pp > 1 else 3)), counts
    if counts["stage"] < 3:  # one gather and one reduce-scatter per unit in the optimizer step (two gathers where
        # backward is split: torch's stage reshards after the last micro-batch's input pass, its weight pass gathers again)
        gathers = 2 if schedule in ("dualpipev", "zbv_zero_bubble") else 1
        assert counts["gathers"] == gathers * counts["scatters"] == gathers * counts["units"], counts
    else:  # regathered for backward, and for every micro-batch or micro-step
        assert counts["gathers"] > accumulate * counts["units"] and counts["scatters"] >= counts["units"], counts


class _LargestTensor(compat.TorchDispatchMode):
    """The most values any op's output holds on this rank (a DTensor's local part; meta tensors hold none)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, local_tensor(t).numel())
        return out


class SetupAllocations(Callback):
    """Watches every op from the callbacks' set-up to ``on_fit_start`` (the strategy shards and materialises the
    model in between); rank 0 saves the largest tensor seen and the initial weights, gathered whole."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def setup(self, trainer, pl_module, stage):
        self._mode = _LargestTensor()
        self._mode.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self._mode.__exit__(None, None, None)
        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save({"largest": self._mode.largest, "weights": weights}, self.path)


def _fit_meta_built(tmp_path, strategy: HybridParallelStrategy, devices: int) -> tuple[DeepSeekMini, dict, dict]:
    """Train a model built under ``init_module(empty_init=True)``; (module, what set-up allocated and materialised,
    the single-process reference trained from those materialised weights)."""
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
        callbacks=[SetupAllocations(tmp_path / "setup.pt")],
    )
    seed_everything(7)
    with trainer.init_module(empty_init=True):
        module = DeepSeekMini(**TINY_MODEL)
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * devices, PER_RANK_BATCH))
    setup = torch.load(tmp_path / "setup.pt")
    weights = {k: w for k, w in setup["weights"].items() if not k.endswith("e_score_correction_bias")}  # zero by design
    assert all(torch.isfinite(w).all() and w.abs().sum() > 0 for w in weights.values())

    def from_materialised() -> DeepSeekMini:
        model = _tiny()
        model.load_state_dict(setup["weights"])
        return model

    return module, setup, reference_training(from_materialised, STEPS, PER_RANK_BATCH * devices)


def test_a_model_built_on_the_meta_device_is_materialised_shard_by_shard_and_trains_like_one_process(tmp_path):
    strategy = HybridParallelStrategy(data_parallel_size=2, data_parallel_shard_size=2, start_method="forkserver")
    module, setup, expected = _fit_meta_built(tmp_path, strategy, 2)
    largest_parameter = max(p.numel() for p in _tiny().parameters())
    # The largest tensor any op made during set-up is a shard of the largest parameter: never a whole one.
    assert 0 < setup["largest"] <= largest_parameter // 2, (setup["largest"], largest_parameter)
    assert_state_close({k: v.detach() for k, v in module.state_dict().items()}, expected, STEPS)


def test_auto_sharding_over_one_data_parallel_rank_materialises_the_meta_model_and_trains_like_one_process(tmp_path):
    """data_parallel_shard_size="auto" with dp resolving to 1: nothing to shard; the meta model is materialised whole."""
    strategy = HybridParallelStrategy(data_parallel_shard_size="auto", start_method="forkserver")
    module, _, expected = _fit_meta_built(tmp_path, strategy, 1)
    assert_state_close({k: v.detach() for k, v in module.state_dict().items()}, expected, STEPS)


class ReduceScatterCount(Callback):
    """The sharded engine's collective count and the units' error-feedback residuals, in ``callback_metrics``."""

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.data_parallel
        comms = engine.gradient_comms
        trainer.callback_metrics.update({
            "rs/collectives": torch.tensor(float(engine.stats.collectives)),
            "rs/units": torch.tensor(float(len(engine.units))),
            "rs/roots": torch.tensor(float(len(engine.roots))),
            "rs/quantized": torch.tensor(float(sum(c.codec is not None for c in comms))),
            "rs/residual_nonzero": torch.tensor(float(sum(bool(c.residual.abs().max() > 0) for c in comms))),
        })


def test_int8_gradient_reduce_scatter_and_weight_all_gather_run_in_every_unit():
    strategy = HybridParallelStrategy(
        data_parallel_size=2, data_parallel_shard_size=2, communication_compression="int8",
        weight_all_gather_compression="int8", start_method="forkserver",
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ReduceScatterCount()],
    )
    module = _tiny().float()
    trainer.fit(module, loader(STEPS * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    counts = {k.split("/")[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rs/")}
    units = counts["units"] + counts["roots"]
    assert counts["quantized"] == units == counts["residual_nonzero"], counts
    # Per step, one int8 reduce-scatter per unit and one int8 all-gather per unit for forward and again for backward
    # (reshard_after_forward=True), the root's only for forward (it is not resharded after it).
    gathers = 2 * counts["units"] + counts["roots"]
    assert counts["collectives"] == STEPS * (units + gathers), counts
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())


class ShardingPolicies(Callback):
    """Rank 0's FSDP2 mixed-precision policy on the root unit, in ``callback_metrics``."""

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.fsdp import fully_shard

        policy = fully_shard.state(pl_module)._mp_policy
        trainer.callback_metrics.update({
            "policy/param_bf16": torch.tensor(float(policy.param_dtype == torch.bfloat16)),
            "policy/reduce_fp32": torch.tensor(float(policy.reduce_dtype == torch.float32)),
        })


def test_bf16_mixed_precision_reaches_fsdp2_and_cpu_offload_on_a_cpu_run_is_refused():
    """``precision="bf16-mixed"`` gathers and computes in bf16 and reduces in float32. ``fsdp_cpu_offload`` is for
    GPUs (FSDP2's offload needs an accelerator; on the CPU the shards are in host memory already)."""
    def trainer(**kwargs):
        strategy = HybridParallelStrategy(data_parallel_size=2, data_parallel_shard_size=2, start_method="forkserver", **kwargs)
        return Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed", callbacks=[ShardingPolicies()],
        )

    mixed, module = trainer(), _tiny().float()
    mixed.fit(module, loader(2 * PER_RANK_BATCH * 2, PER_RANK_BATCH))
    policies = {k.split("/")[1]: float(v) for k, v in mixed.callback_metrics.items() if k.startswith("policy/")}
    assert policies == {"param_bf16": 1.0, "reduce_fp32": 1.0}, policies
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())
    with pytest.raises(ValueError, match="fsdp_cpu_offload=True keeps shards in host memory .* leave fsdp_cpu_offload=False"):
        trainer(fsdp_cpu_offload=True)  # refused before any process starts
