"""The step-time estimate: figures parsed as written on datasheets, each axis on the link its group crosses, the two
bounds and MFU from their definitions."""

import pytest

from lightning_ciuic.planner.estimate import Hardware, estimate_step, parse_flops, parse_links, parse_rate, parse_seconds


def test_datasheet_figures_parse_to_flops_and_bytes_per_second():
    assert parse_flops("989T") == parse_flops("989e12") == parse_flops("989 TFLOPS") == 989e12
    assert parse_rate("900GB/s") == 900e9
    assert parse_rate("400Gbit/s") == parse_rate("400Gbps") == parse_rate("400Gb/s") == 50e9
    assert parse_rate("1GiB/s") == 2**30
    assert parse_links("intra=900GB/s,inter=400Gbit/s") == (900e9, 50e9)
    with pytest.raises(ValueError, match=r"'fast' is not a link speed: write it as 900GB/s"):
        parse_rate("fast")
    with pytest.raises(ValueError, match=r"names \['intra'\]; give both"):
        parse_links("intra=900GB/s")
    with pytest.raises(ValueError, match=r"is not a FLOP/s figure"):
        parse_flops("lots")


def test_each_axis_runs_on_the_link_its_group_crosses_and_the_bounds_follow():
    hardware = Hardware(peak_flops=100e12, intra_node=400e9, inter_node=25e9, devices_per_node=8, efficiency=1.0)
    estimate = estimate_step(
        flops=40e12, forward_flops=10e12,
        traffic={"tp": {"all_reduce": 8e9}, "dp_shard": {"all_gather": 0.5e9, "reduce_scatter": 0.5e9}},
        axis_ranks={"tp": list(range(8)), "dp_shard": [0, 8, 16, 24]},
        hardware=hardware,
    )
    assert estimate.axis_links == {"tp": "intra", "dp_shard": "inter"}
    assert estimate.axis_seconds == {"tp": 8e9 / 400e9, "dp_shard": 1e9 / 25e9}
    assert estimate.compute_seconds == 0.4
    assert estimate.communication_seconds == pytest.approx(0.02 + 0.04)
    assert estimate.overlapped_seconds == 0.4 and estimate.serial_seconds == pytest.approx(0.46)
    assert estimate.model_flops == 30e12  # three forwards: recompute (40 - 30) is not model work
    assert estimate.mfu(estimate.overlapped_seconds) == pytest.approx(0.75)
    with pytest.raises(ValueError, match=r"devices_per_node must be > 0, got 0"):
        Hardware(1e12, 1e9, 1e9, devices_per_node=0)


@pytest.mark.parametrize("fake", [False, True], ids=["real-tensors", "fake-tensors"])
def test_a_tensor_parallel_matmul_counts_the_ranks_shard_not_the_global_product(fake):
    """FlopCounterMode counts a DTensor op at its global shapes (and DTensor's shape propagation again): LocalFlops
    counts what this rank's kernels run."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_ciuic.planner.flops import LocalFlops
    from lightning_ciuic.planner.layout import fake_world

    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            layer = parallelize_module(torch.nn.Linear(64, 128, bias=False), mesh, ColwiseParallel())
            x = torch.randn(8, 64, requires_grad=True)
            with LocalFlops() as counted:
                layer(x).sum().backward()
    forward = 2 * 8 * 64 * (128 // 4)
    assert counted.total == 3 * forward  # forward, the weight's gradient and the input's


def _sharded_layout(name: str, rows: int, cols: int, ranks: int):
    """A stage's one parameter sharded on its rows over ``ranks`` as FSDP2 shards it (a ceiling share each)."""
    from types import SimpleNamespace

    chunk = -(-rows // ranks)
    local = {r: max(0, min(chunk, rows - chunk * r)) * cols for r in range(ranks)}
    spec = SimpleNamespace(name=name, global_shape=(rows, cols), element_size=2, local_numel=local.__getitem__)
    figures = {r: SimpleNamespace(parameter_bytes=2 * local[r]) for r in range(ranks)}
    return SimpleNamespace(stage=0, ranks=list(range(ranks)), tensors=[spec], figures=figures.__getitem__)


def test_the_uneven_shards_warning_says_the_ratio_the_cause_and_remedies_that_fit_the_model():
    from lightning_ciuic.planner.layout import imbalance

    dense = imbalance([_sharded_layout("model.layers.3.mlp.down_proj.weight", 2048, 64, 48)])
    assert "(1.59x)" in dense and "not a multiple of the ranks sharding it" in dense  # 43 rows against 27
    assert "smaller than" not in dense and "expert_parallel_size" not in dense  # a dense weight
    experts = imbalance([_sharded_layout("model.layers.3.mlp.experts.gate_up_proj", 8, 64, 48)])
    assert "all of it" in experts and "smaller than the ranks sharding it" in experts
    assert "shard the experts with expert_parallel_size" in experts


def test_compute_runs_at_the_kernels_efficiency_and_mfu_stays_against_the_peak():
    at_peak = estimate_step(40e12, 10e12, {}, {}, Hardware(100e12, 400e9, 25e9, efficiency=1.0))
    at_half = estimate_step(40e12, 10e12, {}, {}, Hardware(100e12, 400e9, 25e9, efficiency=0.5))
    assert at_peak.compute_seconds == 0.4 and at_half.compute_seconds == 0.8
    assert at_half.mfu(at_half.overlapped_seconds) == pytest.approx(0.375)  # 30 TFLOP of model work in 0.8 s of 100 TFLOP/s
    assert at_half.to_json()["efficiency"] == 0.5
    with pytest.raises(ValueError, match=r"at most 1; got 1.5 \(the default, fitted on published runs, is 0.35\)"):
        Hardware(1e12, 1e9, 1e9, efficiency=1.5)


def test_the_default_efficiency_is_the_fit_and_predicts_the_runs_it_was_not_fitted_on():
    """The planner's default is the mean achieved efficiency of the runs it names; on the others (same device kind)
    the compute-bound prediction lands within 15% of the published throughput (docs/plan.md has the table)."""
    from statistics import fmean

    from lightning_ciuic.planner import efficiency

    assert efficiency.KERNEL_EFFICIENCY == round(fmean(r.achieved() for r in efficiency.FITTED_ON), 2)
    assert Hardware(1e12, 1e9, 1e9).efficiency == efficiency.KERNEL_EFFICIENCY
    a100 = round(fmean(r.achieved() for r in efficiency.A100_FITTED_ON), 2)
    for runs, fitted in ((efficiency.CHECKED_ON, efficiency.KERNEL_EFFICIENCY), (efficiency.A100_CHECKED_ON, a100)):
        assert runs
        for run in runs:
            assert run.predicted_tokens_per_second(fitted) == pytest.approx(run.tokens_per_second, rel=0.15), run.name


def test_the_fp8_speedup_is_the_fit_and_its_checks_are_as_docs_plan_says():
    """FP8 GEMMs' speedup over bf16 ones, fitted on torchtitan's 8B pair of runs with and without Float8: the 8B pair
    at 128 GPUs is predicted within 1%, the 405B pair 16% slow (larger products gain more from FP8, which one constant
    does not model; docs/plan.md)."""
    from lightning_ciuic.planner import efficiency

    assert efficiency.FP8_SPEEDUP == round(efficiency.FP8_FITTED_ON[0].speedup(), 2) == 1.41
    assert Hardware(1e12, 1e9, 1e9).fp8_speedup == efficiency.FP8_SPEEDUP
    small, large = efficiency.FP8_CHECKED_ON
    assert small.predicted_tokens_per_second(efficiency.FP8_SPEEDUP) == pytest.approx(small.fp8_tokens_per_second, rel=0.01)
    assert large.predicted_tokens_per_second(efficiency.FP8_SPEEDUP) == pytest.approx(0.84 * large.fp8_tokens_per_second, rel=0.01)
    assert large.fp8_share == pytest.approx(0.914, abs=1e-3) and small.fp8_share == pytest.approx(0.750, abs=1e-3)


def test_the_defaults_on_published_mixture_of_experts_runs_are_as_docs_plan_says():
    """Not fitted on: Megatron-Core's mixture-of-experts runs over pipelines on H100s and DeepSeek-V3's own, planned at
    the defaults (docs/plan.md, "Checked on published mixture-of-experts runs"). Megatron-Core's run that hides its
    all-to-alls behind another micro-batch's compute is predicted within 4% by the step with every collective hidden,
    DeepSeek's (DualPipe) 24% slow; the two that do not hide them are 27-28% faster than the modelled step with every
    all-to-all exposed: the estimate charges the exposed all-to-alls more than those runs spent on them (outside the
    25% the issue asks, said so in docs/plan.md)."""
    from lightning_ciuic.planner import efficiency

    errors = {run.bound: [] for run in efficiency.MOE_CHECKED_ON}
    for run in efficiency.MOE_CHECKED_ON:
        assert run.tokens_per_step in (32768, 30720), run.name  # micro-batches x 4096 tokens per device a step
        errors[run.bound].append(round(run.error(), 3))
    assert errors == {"modelled": [-0.281, -0.269], "overlapped": [-0.037, -0.243]}


def test_fp8_flops_run_at_the_speedup_and_the_experts_at_the_steps_mean_rate():
    hardware = Hardware(peak_flops=100e12, intra_node=1e9, inter_node=1e9, efficiency=0.5, fp8_speedup=2.0)
    estimate = estimate_step(
        flops=10e12, forward_flops=10e12 / 3, traffic={}, axis_ranks={}, hardware=hardware, fp8_flops=6e12,
        experts_flops=5e12,
    )
    assert estimate.compute_seconds == pytest.approx(4e12 / 50e12 + 6e12 / 100e12)  # 0.08 + 0.06
    assert estimate.experts_compute_seconds == pytest.approx(0.07)  # half the FLOPs, half the time
    assert estimate.to_json()["fp8_flops"] == 6e12 and estimate.to_json()["fp8_speedup"] == 2.0
    with pytest.raises(ValueError, match="fp8_speedup must be > 0, got 0"):
        Hardware(1e12, 1e9, 1e9, fp8_speedup=0)


def test_an_all_to_all_over_nodes_splits_its_bytes_by_where_they_go_and_a_ring_crosses_at_its_bottleneck():
    """ep 16 over two nodes of 8: 7 of a rank's 15 peers share its node. The axis takes its slower link's time."""
    hardware = Hardware(peak_flops=100e12, intra_node=150e9, inter_node=50e9, devices_per_node=8, efficiency=1.0)
    estimate = estimate_step(
        flops=1e12, forward_flops=1e12 / 3,
        traffic={"ep": {"all_to_all": 15e9}, "dp_shard": {"all_gather": 3e9}, "tp": {"all_reduce": 4e9}},
        axis_ranks={"ep": list(range(16)), "dp_shard": [0, 16, 32], "tp": [0, 1, 2, 3]},
        hardware=hardware,
    )
    assert estimate.axis_link_bytes == {
        "ep": {"intra": 7e9, "inter": 8e9}, "dp_shard": {"intra": 0, "inter": 3e9}, "tp": {"intra": 4e9, "inter": 0},
    }
    assert estimate.axis_links == {"ep": "intra+inter", "dp_shard": "inter", "tp": "intra"}
    assert estimate.axis_seconds["ep"] == pytest.approx(max(7e9 / 150e9, 8e9 / 50e9))
    assert estimate.to_json()["link_bytes"]["ep"] == {"intra": 7e9, "inter": 8e9}
    # groups spread unevenly: each member's share of peers on its node, averaged (3 of 4 on node 0, 1 on node 1)
    assert hardware.local_share([0, 1, 2, 8]) == pytest.approx((2 + 2 + 2 + 0) / 12)
def test_the_stage_boundaries_are_found_once_per_configuration_and_compared_across_them(monkeypatch):
    import torch

    from lightning_ciuic.config import ParallelismConfig
    from lightning_ciuic.planner import step

    found = []

    def boundaries(world_size, build, config, spec, depth):
        found.append((config, depth))
        width = 8 if depth is None else depth
        return {s: (torch.empty(2, width, device="meta"), torch.empty(2, width, device="meta")) for s in range(2)}

    monkeypatch.setattr(step, "stage_boundaries", boundaries)
    known, config, spec = step.StageBoundaries(), ParallelismConfig(), step.StepSpec(2, 4)
    first = known.of(4, None, config, spec, 2)
    assert known.of(4, None, config, spec, 2) is first and found == [(config, 2)]  # the second stage asks: no search
    known.of(4, None, config, spec, 4)
    assert found == [(config, 2), (config, 4)]
    assert known.signature(1) == tuple(
        (((2, w), (w, 1), torch.float32, False), ((2, w), (w, 1), torch.float32, False)) for w in (2, 4)
    )


def test_a_plan_with_fewer_micro_batches_than_1f1b_stages_says_the_fix_before_building_anything():
    """Not torch's "use batch sizes divisible by num_microbatches=2" at the step phase: the layout's rule, as fit says it."""
    from lightning_ciuic.config import ParallelismConfig
    from lightning_ciuic.parallel.pipeline_module import PipelineConfig
    from lightning_ciuic.planner import plan_layout

    def build(mesh):
        raise AssertionError("the layout is refused before any stage is built")

    config = ParallelismConfig(pipeline_parallel_size=4, pipeline=PipelineConfig("1f1b", num_microbatches=2))
    expected = r"'1f1b' needs at least as many micro-batches as stages: num_microbatches=2, .*; use num_microbatches >= 4, or pipeline_schedule='gpipe'"
    with pytest.raises(ValueError, match=expected):
        plan_layout(build, config, 8, optimizers=lambda module: [])


@pytest.mark.parametrize("overlap", [False, True], ids=["exposed", "overlapped"])
def test_the_expert_all_to_alls_are_exposed_or_half_hidden_behind_the_other_chunks_experts_up_to_their_length(overlap):
    """Compute 0.4 s (0.2 s of it the experts'); expert all-to-alls 0.5 s (ep_node 0.4 s inter-node, ep_local 0.1 s
    intra-node), dp_shard 0.1 s. Exposed: the step waits for all 0.5 s. Overlapped in two chunks: each layer's first
    dispatch and last combine (half, 0.25 s) have nothing to hide behind; the other half hides behind the other
    chunk's experts up to their 0.2 s: 0.3 s exposed. The other axes run beside the compute; the model lies between
    the bounds."""
    hardware = Hardware(peak_flops=100e12, intra_node=400e9, inter_node=25e9, devices_per_node=8, efficiency=1.0)

    def estimate(experts_flops, bubble=0.0):
        return estimate_step(
            flops=40e12, forward_flops=10e12, hardware=hardware, bubble=bubble, experts_flops=experts_flops, expert_overlap=overlap,
            traffic={"ep_node": {"all_to_all": 10e9}, "ep_local": {"all_to_all": 40e9}, "dp_shard": {"all_gather": 2.5e9}},
            axis_ranks={"ep_node": [0, 8, 16, 24], "ep_local": list(range(8)), "dp_shard": [0, 32, 64, 96]},
        )

    step = estimate(20e12)
    assert step.experts_compute_seconds == pytest.approx(0.2) and step.expert_seconds == pytest.approx(0.5)
    assert (step.overlapped_seconds, step.serial_seconds) == (pytest.approx(0.6), pytest.approx(1.0))
    assert step.exposed_expert_seconds == pytest.approx(0.3 if overlap else 0.5)
    assert step.modelled_seconds == pytest.approx(0.7 if overlap else 0.9)
    assert step.overlapped_seconds <= step.modelled_seconds <= step.serial_seconds
    assert step.to_json()["step_seconds"]["modelled"] == step.modelled_seconds
    # experts longer than the all-to-alls hide the half they can: the first dispatch and last combine stay
    hidden = estimate(35e12)
    assert hidden.exposed_expert_seconds == pytest.approx(0.25 if overlap else 0.5)
    assert hidden.modelled_seconds == pytest.approx(0.65 if overlap else 0.9)
    # a pipeline rank's busy time stretched by the bubble, as the bounds are
    assert estimate(20e12, bubble=0.5).modelled_seconds == pytest.approx(2 * step.modelled_seconds)


def test_an_all_to_all_is_the_expert_dispatchs_whatever_axis_carries_it():
    """ep spanning the data-parallel ranks (dp 4, ep 4) puts the dispatch on the ``dp`` axis beside the gradients'
    all-reduce: its all-to-all bytes are still the experts' (on the compute's path), the all-reduce is not."""
    hardware = Hardware(peak_flops=100e12, intra_node=400e9, inter_node=10e9, devices_per_node=2, efficiency=1.0)
    step = estimate_step(
        flops=10e12, forward_flops=2.5e12, hardware=hardware, traffic={"dp": {"all_to_all": 2e9, "all_reduce": 1e9}},
        axis_ranks={"dp": [0, 1, 2, 3]},
    )
    # of the all-to-all's 2e9 bytes a third stays on the node (1 of 3 peers): 1.33e9 cross at 10 GB/s
    assert step.expert_seconds == pytest.approx(2e9 * 2 / 3 / 10e9)
    assert step.axis_seconds["dp"] == pytest.approx((2e9 * 2 / 3 + 1e9) / 10e9)
    assert step.modelled_seconds == pytest.approx(0.1 + step.expert_seconds)


def test_each_collective_call_costs_the_latency_given_besides_its_bytes():
    """An alpha-beta model: 10 calls on dp_shard and 6 all-to-alls on ep at 1 ms each, besides their bytes' time."""
    hardware = Hardware(peak_flops=100e12, intra_node=400e9, inter_node=10e9, devices_per_node=8, efficiency=1.0, latency=1e-3)
    traffic = {"dp_shard": {"all_gather": 1e9}, "ep": {"all_to_all": 4e9}}
    ranks = {"dp_shard": [0, 8], "ep": list(range(8))}
    step = estimate_step(10e12, 2.5e12, traffic, ranks, hardware, calls={"dp_shard": {"all_gather": 10}, "ep": {"all_to_all": 6}})
    assert step.axis_seconds == {"dp_shard": pytest.approx(0.1 + 0.01), "ep": pytest.approx(0.01 + 0.006)}
    assert step.expert_seconds == pytest.approx(0.016)
    assert estimate_step(10e12, 2.5e12, traffic, ranks, hardware).axis_seconds["ep"] == pytest.approx(0.01)  # no calls given
    assert parse_seconds("20us") == pytest.approx(2e-5) and parse_seconds("3.5ms") == pytest.approx(3.5e-3)
    with pytest.raises(ValueError, match="latency is the seconds a collective call costs"):
        Hardware(1e12, 1e9, 1e9, latency=-1.0)


def test_the_experts_forward_flops_are_counted_apart_and_scale_the_steps():
    """The packed experts' module is watched; the attention beside it and the dense layer are not."""
    import torch
    from torch import nn

    from lightning_ciuic.planner.flops import LocalFlops, experts_modules
    from lightning_ciuic.planner.train_step import StepFigures

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(2, 8, 4))
            self.down_proj = nn.Parameter(torch.randn(2, 4, 4))
            self.act_fn = torch.nn.functional.silu

        def forward(self, x):
            return x @ self.gate_up_proj[0].t()[:, :4] @ self.down_proj[0]

    class Layer(nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.attn = nn.Linear(4, 4, bias=False)
            self.mlp = nn.Module()
            self.mlp.experts = Experts() if moe else nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return self.mlp.experts(self.attn(x))

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(False), Layer(True)])
    assert experts_modules(model) == [model.layers[1].mlp.experts]
    counter = LocalFlops()
    with counter, counter.watching(experts_modules(model)):
        x = torch.randn(3, 4, requires_grad=True)
        model.layers[1](model.layers[0](x)).sum().backward()
    per_matmul = 2 * 3 * 4 * 4
    assert (counter.forward, counter.experts_forward) == (5 * per_matmul, 2 * per_matmul)  # 2 dense, the attention, 2 experts'
    figures = StepFigures(0, {}, {}, counter.total, counter.forward, counter.experts_forward)
    assert figures.experts_flops == pytest.approx(counter.total * 2 / 5)


def test_the_stage_whose_modelled_step_is_longest_sets_the_pace_not_the_one_with_most_flops():
    """Two pipeline stages: stage 0 computes 1% more, stage 1 sends twice the expert all-to-alls (DeepSeek-V3 under
    DualPipeV: its rank 1 holds two MoE layers, the others four). With the hardware given, stage 1's step is the
    longer and sets the pace (the step estimate is its); without it, the FLOPs decide."""
    from lightning_ciuic.parallel.dims import ParallelDims
    from lightning_ciuic.planner.report import Plan
    from lightning_ciuic.planner.train_step import StepFigures

    hardware = Hardware(peak_flops=100e12, intra_node=400e9, inter_node=25e9, devices_per_node=8, efficiency=1.0)

    def stage(flops, all_to_all):
        return StepFigures(0, {"ep": {"all_to_all": all_to_all}}, {"ep": [0, 8]}, flops, flops // 3)

    steps = {0: stage(40.4e12, 5e9), 1: stage(40e12, 10e9)}
    plan = Plan(16, ParallelDims(pp=2, dp=8, tp=1, world_size=16, ep=8), 0, [], 80 * 2**30, steps=steps, num_microbatches=4, hardware=hardware)
    assert plan.pacing_stage == 1
    assert plan.estimate.modelled_seconds == pytest.approx((0.4 + 10e9 / 25e9) / (1 - plan.estimate.bubble))
    assert plan.estimate.modelled_seconds > plan._estimate_of(0).modelled_seconds
    plan.hardware = None
    assert plan.pacing_stage == 0 and plan.estimate is None


def test_under_dualpipev_the_paired_share_of_the_all_to_alls_hides_behind_the_other_micro_batchs_compute():
    """The step above (compute 0.4 s, 0.2 s of it the experts'; expert all-to-alls 0.5 s), half of its passes in
    DualPipeV's forward-backward pairs: their 0.25 s of all-to-alls hide behind their 0.2 s of compute (0.05 s
    exposed), the other 0.25 s as two chunks (0.125 s exposed at once, 0.125 s behind 0.1 s of experts: 0.15 s).
    A plan takes each rank's share from the schedule, with expert_dispatch_overlap only."""
    from lightning_ciuic.parallel.dims import ParallelDims
    from lightning_ciuic.parallel.schedule_bubble import paired_fraction
    from lightning_ciuic.planner.layout import RankBytes
    from lightning_ciuic.planner.report import Plan, RankClass
    from lightning_ciuic.planner.train_step import StepFigures

    hardware = Hardware(peak_flops=100e12, intra_node=400e9, inter_node=25e9, devices_per_node=8, efficiency=1.0)
    traffic = {"ep_node": {"all_to_all": 10e9}, "ep_local": {"all_to_all": 40e9}}
    ranks = {"ep_node": [0, 8, 16, 24], "ep_local": list(range(8))}
    step = estimate_step(40e12, 10e12, traffic, ranks, hardware, experts_flops=20e12, expert_overlap=True, paired=0.5)
    assert step.exposed_expert_seconds == pytest.approx(0.05 + 0.15)
    assert step.to_json()["paired"] == 0.5
    all_paired = estimate_step(40e12, 10e12, traffic, ranks, hardware, experts_flops=20e12, expert_overlap=True, paired=1.0)
    assert all_paired.exposed_expert_seconds == pytest.approx(0.1)  # what 0.4 s of compute cannot cover

    assert [round(paired_fraction("dualpipev", 4, 8, rank), 4) for rank in range(4)] == [10 / 32, 12 / 32, 14 / 32, 14 / 32]
    assert paired_fraction("zbv_zero_bubble", 4, 8, 1) == paired_fraction("1f1b", 4, 8, 1) == 0.0
    figures = StepFigures(0, traffic, ranks, 40e12, 10e12, 20e12)
    for overlap in (False, True):
        plan = Plan(
            32, ParallelDims(pp=4, dp=8, tp=1, world_size=32, ep=8), 0,
            [RankClass(list(range(8 * r, 8 * r + 8)), r, RankBytes()) for r in range(4)], 80 * 2**30, steps={r: figures for r in range(4)},
            num_microbatches=8, pipeline_schedule="dualpipev", stages_per_rank=2, hardware=hardware, expert_overlap=overlap,
        )
        assert [plan._estimate_of(r).paired for r in range(4)] == (
            [paired_fraction("dualpipev", 4, 8, r) for r in range(4)] if overlap else [0.0] * 4
        )
    assert "of them in dualpipev's forward-backward pairs, behind the other micro-batch's compute" in plan.table()
