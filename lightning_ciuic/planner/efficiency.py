"""Achieved kernel efficiency: the fraction of a device's peak FLOP/s a training step's kernels reach, fitted on
published runs and checked on others.

Contract: a :class:`PublishedRun` is a run whose throughput was published (tokens per second per device), with the
FLOPs our planner counts for one rank's step of the same model, layout, micro-batch and recomputation
(``lightning-ciuic plan ... --json``: ``step_estimate.flops``; the commands are in docs/plan.md). For a run whose
communication hides behind compute, its published step takes ``tokens_per_step / tokens_per_second`` seconds, and
:meth:`PublishedRun.achieved` is ``step_flops / (peak_flops * step seconds)``. :data:`KERNEL_EFFICIENCY`, the
planner's default, is the mean achieved efficiency of :data:`FITTED_ON`; :data:`CHECKED_ON` are runs it was not
fitted on, whose predicted throughput (:meth:`PublishedRun.predicted_tokens_per_second`) docs/plan.md compares with
the published one (within 15%: kernels of larger models reach more of the peak, which one constant does not model).
:data:`FP8_SPEEDUP` is the same for FP8 GEMMs: how many times faster than bf16 GEMMs they ran in published pairs of
runs with and without them (:class:`Float8Run`), fitted on :data:`FP8_FITTED_ON`, checked on :data:`FP8_CHECKED_ON`. :data:`A100_FITTED_ON` and :data:`A100_CHECKED_ON` do the same for A100s, whose kernels reach
a larger fraction of their (lower) peak: pass ``--efficiency`` for such devices. :data:`MOE_CHECKED_ON` checks both
defaults on published mixture-of-experts runs over pipelines (:class:`PlannedRun`), on the whole planned step:
compute, the schedule's bubble and the expert all-to-alls.

No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

H100_BF16 = 989e12  # dense bf16 peak of an H100 SXM (also H800's), FLOP/s
A100_BF16 = 312e12

TORCHTITAN_BENCHMARK = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26)"
TORCHTITAN_PERFORMANCE = "pytorch/torchtitan docs/performance.md at commit 4d88a8a (2024-12-03)"
TORCHTITAN_PERFORMANCE_405B = TORCHTITAN_PERFORMANCE + ", Llama 3.1 table (None, Float8)"


@dataclass(frozen=True)
class PublishedRun:
    """A published run and what the planner counts for one rank's step of it (see the module docstring)."""

    name: str
    source: str
    peak_flops: float  # the device's dense bf16 peak
    tokens_per_second: float  # published, per device
    tokens_per_step: int  # one device's tokens per optimizer step: micro-batch x sequence x micro-batches
    step_flops: int  # the planner's count for one rank's step, recomputation included

    @property
    def published_step_seconds(self) -> float:
        return self.tokens_per_step / self.tokens_per_second

    def achieved(self) -> float:
        """The fraction of the peak the published run's kernels reached."""
        return self.step_flops / (self.peak_flops * self.published_step_seconds)

    def predicted_tokens_per_second(self, efficiency: float) -> float:
        """What the estimate predicts for this run at ``efficiency``, compute-bound."""
        return self.tokens_per_step / (self.step_flops / (self.peak_flops * efficiency))


FITTED_ON = (
    PublishedRun(
        "Llama 3.1 8B, FSDP 8 on 8 H100 (500 W), local batch 2 x 8192, bf16, selective recomputation (planned without)",
        TORCHTITAN_BENCHMARK + ", Table 1 (FSDP)", H100_BF16, 5762, 2 * 8192, 984_028_547_121_152,
    ),
)
CHECKED_ON = (
    PublishedRun(
        "Llama 3.1 8B, FSDP 128 on 128 H100 (500 W), local batch 2 x 8192, bf16, selective recomputation (planned without)",
        TORCHTITAN_BENCHMARK + ", Table 3 (FSDP)", H100_BF16, 5605, 2 * 8192, 984_028_547_121_152,
    ),
    PublishedRun(  # tokens per device: the tp 8 ranks share their batch (torchtitan divides by the non-data-parallel size)
        "Llama 3.1 405B, FSDP 16 x TP 8 on 128 H100, local batch 2 x 8192, bf16, full recomputation",
        TORCHTITAN_PERFORMANCE + ", Llama 3.1 table (no Float8)", H100_BF16, 109,
        2 * 8192 // 8, 6_779_571_516_997_632,
    ),
)
A100_FITTED_ON = (
    PublishedRun(
        "Llama 3 8B, FSDP 64 on 64 A100, local batch 1 x 8192, bf16, selective op recomputation (planned without)",
        TORCHTITAN_PERFORMANCE + ", Llama 3 table", A100_BF16, 2973, 8192, 492_014_273_560_576,
    ),
)
A100_CHECKED_ON = (
    PublishedRun(
        "Llama 3 70B, FSDP 64 on 64 A100, local batch 1 x 8192, bf16, full recomputation",
        TORCHTITAN_PERFORMANCE + ", Llama 3 table", A100_BF16, 331, 8192, 5_021_435_244_314_624,
    ),
)

KERNEL_EFFICIENCY = round(fmean(run.achieved() for run in FITTED_ON), 2)


@dataclass(frozen=True)
class Float8Run:
    """A published pair of runs, the same but for FP8 GEMMs, and the planner's FLOPs of one rank's step of them.

    The FP8 run multiplies every ``nn.Linear`` but the output layer in FP8, all of its GEMMs (torchtitan's Float8).
    The planner, with ``gemm_precision="fp8"``, counts ``fp8_flops``: the GEMMs the pack runs in FP8, forward and
    input gradient (recomputed forwards too: ``fp8_passes`` of them per weight-gradient GEMM, 2, or 3 with full
    recomputation), so the published run's share of FP8 FLOPs is ``fp8_flops (passes + 1) / passes / step_flops``
    (:attr:`fp8_share`). With its other kernels as fast in both runs, the FP8 run's step is ``1 - share + share /
    speedup`` of the other's: :meth:`speedup` solves it for the published pair, :meth:`predicted_tokens_per_second`
    applies one."""

    name: str
    source: str
    tokens_per_second: float  # published, per device, without FP8
    fp8_tokens_per_second: float  # published, per device, with FP8 GEMMs
    step_flops: int  # the planner's, one rank's step
    fp8_flops: int  # of them, the FP8 GEMMs' under gemm_precision="fp8"
    fp8_passes: int  # FP8 GEMMs per weight-gradient GEMM in the pack's recipe: 2, 3 with full recomputation

    @property
    def fp8_share(self) -> float:
        return self.fp8_flops * (self.fp8_passes + 1) / self.fp8_passes / self.step_flops

    def speedup(self) -> float:
        """How many times faster the FP8 GEMMs ran than the same GEMMs in bf16."""
        step_ratio = self.tokens_per_second / self.fp8_tokens_per_second
        return self.fp8_share / (step_ratio - 1 + self.fp8_share)

    def predicted_tokens_per_second(self, speedup: float) -> float:
        return self.tokens_per_second / (1 - self.fp8_share + self.fp8_share / speedup)


_LLAMA31_8B = dict(step_flops=984_028_547_121_152, fp8_flops=491_825_294_999_552, fp8_passes=2)
FP8_FITTED_ON = (
    Float8Run(
        "Llama 3.1 8B, FSDP 8 on 8 H100 (500 W), 2 x 8192, torch.compile, with and without Float8",
        TORCHTITAN_BENCHMARK + ", Table 1", 6667, 8532, **_LLAMA31_8B,
    ),
)
FP8_CHECKED_ON = (
    Float8Run(
        "Llama 3.1 8B, FSDP 128 on 128 H100 (500 W), 2 x 8192, torch.compile, with and without Float8",
        TORCHTITAN_BENCHMARK + ", Table 3", 6514, 8380, **_LLAMA31_8B,
    ),
    Float8Run(  # planned at tp 1 (the pack's FP8 GEMMs refuse tp): the share of FLOPs does not depend on it
        "Llama 3.1 405B, FSDP 16 x TP 8 on 128 H100, 2 x 8192, full recomputation, with and without Float8",
        TORCHTITAN_PERFORMANCE_405B, 109, 177, 57_907_429_144_264_704, 39_690_033_300_504_576, 3,
    ),
)
FP8_SPEEDUP = round(fmean(run.speedup() for run in FP8_FITTED_ON), 2)
"""How many times faster FP8 GEMMs run than bf16 ones, fitted on :data:`FP8_FITTED_ON` (the step estimate's default)."""


MEGATRON_MODELZOO_QWEN3 = "yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md at c1ad0b5 (Megatron-Core moe_dev f3e6c5)"
MEGATRON_BRIDGE_H100 = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.09 NeMo container, DGX-H100 table"


@dataclass(frozen=True)
class PlannedRun:
    """A published run of a mixture-of-experts model over a pipeline, checked on its whole step: ``planned_seconds`` is
    the planner's step of one rank for the same model, layout, micro-batches and recomputation at the defaults
    (:data:`KERNEL_EFFICIENCY`, :data:`FP8_SPEEDUP`; ``lightning-ciuic plan ... --json``, ``step_estimate.step_seconds``):
    its ``"modelled"`` step with the all-to-alls as the published run ran them (``bound``: ``"modelled"`` with the
    dispatch not overlapped, for a run that does not overlap it; ``"overlapped"``, every collective hidden behind
    compute, for a run that hides its all-to-alls behind another micro-batch's compute, as Megatron-Core's 1F1B
    overlap does). Not fitted on: the defaults are the dense runs' above."""

    name: str
    source: str
    tokens_per_second: float  # published, per device
    tokens_per_step: int  # one device's tokens per step in the plan
    bound: str  # "modelled" or "overlapped": the planned step that matches how the run ran its all-to-alls
    planned_seconds: float

    def predicted_tokens_per_second(self) -> float:
        return self.tokens_per_step / self.planned_seconds

    def error(self) -> float:
        """The prediction's error, a fraction of the published throughput (negative: predicted slower)."""
        return self.predicted_tokens_per_second() / self.tokens_per_second - 1


DEEPSEEK_V3_REPORT = "DeepSeek-V3 Technical Report (arXiv 2412.19437), 180K H800 GPU-hours per trillion tokens"
MOE_CHECKED_ON = (
    PlannedRun(  # planned at tp 1 x dp 128 and 64 micro-batches (the run: tp 2 x dp 64, 128): the same tokens per device
        "DeepSeek-V3, PP 8 (4 virtual stages) x EP 64 on 1024 H100, 1 x 4096, FP8 GEMMs, DeepEP, the all-to-alls not"
        " overlapped (the H100 recipe leaves moe_a2a_overlap off); planned with the hierarchical fp8 dispatch",
        MEGATRON_BRIDGE_H100, 1297, 64 * 4096 * 128 // 1024, "modelled", 35.159518605866054,
    ),
    PlannedRun(
        "Qwen3-235B-A22B, PP 8 (4 virtual stages) x EP 32 on 256 H100, 1 x 4096, bf16, DeepEP, the all-to-alls not"
        " overlapped; planned with the hierarchical dispatch",
        MEGATRON_MODELZOO_QWEN3 + ", 19.7 s a step", 2048 * 4096 / 256 / 19.7, 64 * 4096 * 32 // 256, "modelled",
        26.94493330477288,
    ),
    PlannedRun(
        "Qwen3-235B-A22B, the same with Megatron-Core's 1F1B all-to-all overlap (one micro-batch's forward with"
        " another's backward)",
        MEGATRON_MODELZOO_QWEN3 + ", 17.6 s a step", 2048 * 4096 / 256 / 17.6, 64 * 4096 * 32 // 256, "overlapped",
        18.27342319644399,
    ),
    PlannedRun(  # planned under 1F1B: DualPipeV with whole backwards (fits since 2026-12-07) bounds it at 26.06 s, 1% less
        "DeepSeek-V3 as its report trains it: PP 16 x EP 64 x DP 128 on 2048 H800, 120 micro-batches of 1 x 4096, FP8"
        " GEMMs, node-limited dispatch, DualPipe hiding the all-to-alls; planned under 1F1B with the recipe of"
        " docs/plan.md",
        DEEPSEEK_V3_REPORT, 1543, 120 * 4096 * 128 // 2048, "overlapped", 26.316333318788725,
    ),
)
