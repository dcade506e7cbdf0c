"""Achieved kernel efficiency: the fraction of a device's peak FLOP/s a training step's kernels reach, fitted on
published runs and checked on others.

Contract: a :class:`PublishedRun` is a run whose throughput was published (tokens per second per device), with the
FLOPs our planner counts for one rank's step of the same model, layout, micro-batch and recomputation
(``lightning-ciuic plan ... --json``: ``step_estimate.flops``; the commands are in docs/plan.md). For a run whose
communication hides behind compute, its published step takes ``tokens_per_step / tokens_per_second`` seconds, and
:meth:`PublishedRun.achieved` is ``step_flops / (peak_flops * step seconds)``. :data:`KERNEL_EFFICIENCY`, the
planner's default, is the mean achieved efficiency of :data:`FITTED_ON`; :data:`CHECKED_ON` are runs it was not
fitted on, whose predicted throughput (:meth:`PublishedRun.predicted_tokens_per_second`) docs/plan.md compares with
the published one (within 15%: kernels of larger models reach more of the peak, which one constant does not model). :data:`A100_FITTED_ON` and :data:`A100_CHECKED_ON` do the same for A100s, whose kernels reach
a larger fraction of their (lower) peak: pass ``--efficiency`` for such devices.

No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

H100_BF16 = 989e12  # dense bf16 peak of an H100 SXM (also H800's), FLOP/s
A100_BF16 = 312e12

TORCHTITAN_BENCHMARK = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26)"
TORCHTITAN_PERFORMANCE = "pytorch/torchtitan docs/performance.md at commit 4d88a8a (2024-12-03)"


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
