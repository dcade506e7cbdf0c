"""A plan's result: its rank classes, their figures, and the two ways it is shown (``--json`` and the table).

Contract: :class:`Plan` holds what :func:`~lightning_ciuic.planner.plan_layout` found; :meth:`Plan.to_json` is the
``--json`` document (numbers as integers, ``null`` where the step phase did not run), :meth:`Plan.table` the printed
one. A :class:`RankClass` fits when its peak (the step phase's, else its model states plus one gathered FSDP2 unit,
a lower bound) is at most the device memory. With the step phase and a :class:`~lightning_ciuic.planner.estimate.
Hardware`, :attr:`Plan.estimate` is the step's time and MFU (:mod:`~lightning_ciuic.planner.estimate`).

No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.parallel.experts.overlap import CHUNKS
from lightning_ciuic.parallel.pipeline import SPLIT_BACKWARD_SCHEDULES
from lightning_ciuic.parallel.schedule_bubble import paired_fraction, schedule_bubble
from lightning_ciuic.planner.estimate import Hardware, StepEstimate, estimate_step
from lightning_ciuic.planner.layout import RankBytes

GiB = 1024**3
NOT_MODELLED = (
    "the CUDA context and kernels' workspaces",
    "NCCL's buffers",
    "the caching allocator's fragmentation",
    "which kernels CUDA picks",
    "in a step-time estimate: kernel efficiency other than the one given (--efficiency), collectives' latency other than the one given (--collective-latency), links shared within a node",
)


@dataclass
class RankClass:
    """Ranks of one pipeline stage with equal figures."""

    ranks: list[int]
    pp_stage: int
    figures: RankBytes
    gathered_unit: int = 0  # bytes of the largest FSDP2 unit gathered at once
    activations: Optional[int] = None  # from the step phase
    peak: Optional[int] = None  # from the step phase

    @property
    def model_states(self) -> int:
        f = self.figures
        return f.parameter_bytes + f.gradient_bytes + f.optimizer_bytes + f.buffer_bytes

    def needed(self) -> int:
        """The peak where the step phase ran, else the model states and one gathered unit (a lower bound)."""
        return self.peak if self.peak is not None else self.model_states + self.gathered_unit


@dataclass
class Plan:
    """What :func:`plan` found (see the module docstring)."""

    world_size: int
    dims: ParallelDims
    total_parameters: int
    classes: list[RankClass]
    device_memory: int
    largest_units: dict[int, tuple[str, int]] = field(default_factory=dict)  # pp stage -> (unit, bytes gathered)
    warnings: list[str] = field(default_factory=list)
    steps: dict[int, Any] = field(default_factory=dict)  # pp stage -> its first rank's StepFigures (the step phase)
    num_microbatches: int = 1  # per step, under pipeline parallelism
    pipeline_schedule: str = "1f1b"  # and its schedule, with the stages each rank holds
    stages_per_rank: int = 1
    max_deferred_weight_backwards: Optional[int] = None
    hardware: Optional[Hardware] = None
    expert_overlap: bool = False  # the expert dispatch's two chunks per micro-batch (expert_dispatch_overlap)
    not_modelled: tuple[str, ...] = NOT_MODELLED

    @property
    def pacing_stage(self) -> Optional[int]:
        """The pipeline stage at whose pace a pipeline moves (the only stage without pipeline parallelism): with the
        hardware given, the one whose rank's modelled step is the longest (its compute and the communication it does
        not hide: a stage of fewer FLOPs but more expert all-to-alls can set it), else the one whose rank computes
        the most FLOPs per step; None without the step phase."""
        if not self.steps:
            return None
        if self.hardware is None:
            return max(self.steps, key=lambda stage: (self.steps[stage].flops, -stage))
        return max(self.steps, key=lambda stage: (self._estimate_of(stage).modelled_seconds, -stage))

    @property
    def pacing_step(self) -> Optional[Any]:
        """The pacing stage's StepFigures: one of its ranks' FLOPs, collective bytes and groups (None without the step
        phase)."""
        return self.steps[self.pacing_stage] if self.steps else None

    @property
    def estimate(self) -> Optional[StepEstimate]:
        """The step's time and MFU, where the step phase ran and the hardware is given: the pacing stage's rank, its
        busy time stretched by the schedule's bubble (:func:`~lightning_ciuic.parallel.schedule_bubble.schedule_bubble`:
        the schedule's own order of actions played with equal stages), MFU over the model FLOPs of all stages' ranks."""
        if self.hardware is None or not self.steps:
            return None
        return self._estimate_of(self.pacing_stage)

    @property
    def _deferred_limit(self) -> str:
        limit = self.max_deferred_weight_backwards
        return "" if limit is None else f", at most {limit} weight backwards deferred"

    def _estimate_of(self, stage: int) -> StepEstimate:
        """The estimate of a step at the pace of ``stage``'s rank (see :attr:`estimate`)."""
        figures, d = self.steps[stage], self.dims
        bubble = schedule_bubble(
            self.pipeline_schedule, d.pp, self.num_microbatches, self.stages_per_rank, self.max_deferred_weight_backwards
        )
        paired = paired_fraction(self.pipeline_schedule, d.pp, self.num_microbatches, stage, self.stages_per_rank)
        model_forward = sum(f.forward_flops for f in self.steps.values()) / len(self.steps)
        return estimate_step(
            figures.flops, model_forward, figures.traffic, figures.axis_ranks, self.hardware, bubble=bubble,
            experts_flops=figures.experts_flops, expert_overlap=self.expert_overlap, calls=figures.calls,
            fp8_flops=figures.fp8_flops, paired=paired if self.expert_overlap else 0.0,
        )

    def fits(self, rank_class: RankClass) -> bool:
        return rank_class.needed() <= self.device_memory

    @property
    def most_needed(self) -> int:
        """The memory the most loaded rank class needs (:meth:`RankClass.needed`)."""
        return max(c.needed() for c in self.classes)

    @property
    def all_fit(self) -> bool:
        return all(self.fits(c) for c in self.classes)

    @property
    def advice(self) -> list[str]:
        """What to change that the plan can tell: under a split-backward schedule whose deferred weight backwards are
        not limited, with ranks whose stepped peak does not fit, ``max_deferred_weight_backwards`` and its bubble."""
        d = self.dims
        over = [c for c in self.classes if c.peak is not None and not self.fits(c)]
        if d.pp == 1 or not over or self.pipeline_schedule not in SPLIT_BACKWARD_SCHEDULES or self.max_deferred_weight_backwards is not None:
            return []
        bubble = [schedule_bubble(self.pipeline_schedule, d.pp, self.num_microbatches, self.stages_per_rank, k) for k in (None, 1, 0)]
        return [
            f"{len(over)} rank class{'es' if len(over) > 1 else ''} do{'' if len(over) > 1 else 'es'} not fit, and {self.pipeline_schedule} lets a rank defer weight backwards to the"
            " step's end, each keeping its chunk's graph and output gradients until it runs:"
            f" max_deferred_weight_backwards: 1 bounds them, the bubble {bubble[0]:.1%} -> {bubble[1]:.1%}; 0 runs whole"
            f" backwards, none pending, the bubble {bubble[2]:.1%} (docs/pipeline.md)."
        ]

    def layout(self) -> dict[str, int]:
        d = self.dims
        return {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "ep": d.ep}

    def bytes_per_axis(self) -> Optional[dict[str, int]]:
        """Bytes one rank sends per step on each mesh axis (``None`` without the step phase)."""
        pacing = self.pacing_step
        return _axis_totals(pacing.traffic) if pacing is not None else None

    def to_json(self) -> dict[str, Any]:
        pacing = self.pacing_step
        classes = []
        for c in self.classes:
            f = c.figures
            classes.append({
                "ranks": c.ranks,
                "pp_stage": c.pp_stage,
                "parameters": f.parameters,
                "bytes": {
                    "parameters": f.parameter_bytes, "gradients": f.gradient_bytes, "optimizer": f.optimizer_bytes,
                    "buffers": f.buffer_bytes, "gathered_unit": c.gathered_unit, "activations": c.activations,
                    "peak": c.peak,
                },
                "fits": self.fits(c),
            })
        return {
            "world_size": self.world_size,
            "layout": self.layout(),
            "total_parameters": self.total_parameters,
            "device_memory": self.device_memory,
            "rank_classes": classes,
            "communication_bytes_per_step": self.bytes_per_axis(),
            "communication_by_collective": pacing.traffic if pacing is not None else None,
            "flops_per_step": pacing.flops if pacing is not None else None,
            "pacing_stage": self.pacing_stage,
            "stage_steps": [
                {
                    "pp_stage": stage, "flops": f.flops, "forward_flops": f.forward_flops,
                    "experts_forward_flops": f.experts_forward_flops, "fp8_flops": f.fp8_flops, "activations": f.activations,
                    "communication_bytes_per_step": _axis_totals(f.traffic), "calls": f.calls,
                }
                for stage, f in sorted(self.steps.items())
            ],
            "step_estimate": estimate.to_json() if (estimate := self.estimate) is not None else None,
            "warnings": self.warnings,
            "advice": self.advice,
            "not_modelled": list(self.not_modelled),
        }

    def table(self) -> str:
        """The plan as text: the layout, one row per rank class, the warnings, what is not modelled."""
        largest = self.most_needed
        unit, scale = next((u, s) for u, s in UNITS if largest >= 10 * s or s == 1)

        def size(value: Optional[int]) -> str:
            return f"{'-':>9}" if value is None else f"{value / scale:>9.2f}"

        lines = [
            f"{self.dims}: {_count(self.total_parameters)} parameters, {self.device_memory / GiB:.1f} GiB per device",
            f"{'ranks':<24} {'stage':>5} {'params':>9} {'weights':>9} {'grads':>9} {'optim':>9} {'buffers':>9}"
            f" {'gathered':>9} {'activ.':>9} {'peak':>9} {'headroom':>9}  fits ({unit})",
        ]
        for c in self.classes:
            f = c.figures
            lines.append(
                f"{_ranges(c.ranks):<24} {c.pp_stage:>5} {_count(f.parameters):>9} {size(f.parameter_bytes)} {size(f.gradient_bytes)}"
                f" {size(f.optimizer_bytes)} {size(f.buffer_bytes)} {size(c.gathered_unit)} {size(c.activations)}"
                f" {size(c.peak)} {size(self.device_memory - c.needed())}  {'yes' if self.fits(c) else 'NO'}"
            )
        if any(c.peak is None for c in self.classes):
            lines.append("(no step phase: the peak is not known, and 'fits' compares the model states plus one gathered unit)")
        for stage, figures in sorted(self.steps.items()):
            sent = ", ".join(
                f"{axis} {_bytes(sum(by.values()))} ({', '.join(f'{name} {_bytes(v)}' for name, v in sorted(by.items()))})"
                for axis, by in sorted(figures.traffic.items())
            )
            whose = "one rank" if len(self.steps) == 1 else f"a rank of stage {stage}"
            lines.append(f"sent per step by {whose}, per mesh axis: {sent or 'nothing'}")
        estimate = self.estimate
        if estimate is not None:
            by_axis = ", ".join(
                f"{axis} {seconds * 1e3:.2f} ms ({_links(estimate.axis_link_bytes[axis])})"
                for axis, seconds in sorted(estimate.axis_seconds.items())
            )
            if estimate.bubble:
                lines.append(
                    f"pipeline: stage {self.pacing_stage} sets the pace (the longest modelled step); the schedule's bubble"
                    f" {estimate.bubble:.1%} of the step ({self.pipeline_schedule}, pp={self.dims.pp}, {self.num_microbatches}"
                    f" micro-batches{self._deferred_limit})"
                )
            lines.append(
                f"step time: {estimate.overlapped_seconds * 1e3:.2f} ms (communication hidden) to"
                f" {estimate.serial_seconds * 1e3:.2f} ms (none hidden); MFU {estimate.mfu(estimate.overlapped_seconds):.1%}"
                f" to {estimate.mfu(estimate.serial_seconds):.1%}; compute {estimate.compute_seconds * 1e3:.2f} ms"
                f" ({estimate.flops / 1e12:.3g} TFLOP at {estimate.efficiency:.0%} of {estimate.peak_flops / 1e12:.4g} TFLOP/s"
                + (f", {estimate.fp8_flops / 1e12:.3g} of them by FP8 GEMMs at {estimate.fp8_speedup:.2f}x" if estimate.fp8_flops else "")
                + "),"
                " communication"
                f" {by_axis or 'none'}"
            )
            if estimate.expert_seconds:
                how = (
                    f"overlapped in {CHUNKS} chunks (each layer's first dispatch and last combine exposed, the rest behind"
                    f" the other chunk's experts' compute, {estimate.experts_compute_seconds * 1e3:.2f} ms)"
                    if estimate.expert_overlap else "not overlapped (expert_dispatch_overlap off)"
                )
                if estimate.paired:
                    how = (
                        f"{estimate.paired:.1%} of them in {self.pipeline_schedule}'s forward-backward pairs, behind the"
                        f" other micro-batch's compute, the rest {how}"
                    )
                lines.append(
                    f"modelled step: {estimate.modelled_seconds * 1e3:.2f} ms, MFU {estimate.mfu(estimate.modelled_seconds):.1%}:"
                    f" expert all-to-alls {estimate.expert_seconds * 1e3:.2f} ms, {estimate.exposed_expert_seconds * 1e3:.2f} ms"
                    f" of them exposed, {how}; the other axes beside the compute"
                )
        elif self.steps:
            lines.append(
                f"FLOPs per step of one rank: {self.pacing_step.flops:.4g} (give --flops and --link for a step-time estimate)"
            )
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"advice: {a}" for a in self.advice]
        lines.append("not modelled: " + ", ".join(self.not_modelled) + ".")
        return "\n".join(lines)


UNITS = (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024), ("bytes", 1))


def _bytes(n: int) -> str:
    """``1536`` as ``"1.50 KiB"``."""
    unit, scale = next((u, s) for u, s in UNITS if n >= s or s == 1)
    return f"{n / scale:.2f} {unit}" if scale > 1 else f"{n} bytes"


def _count(n: int) -> str:
    """``70553706496`` as ``"70.55B"``, ``1234567`` as ``"1.23M"``."""
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _links(by_link: dict[str, int]) -> str:
    """``intra-node``, ``inter-node``, or both with their bytes when an axis's bytes cross both links."""
    crossed = [link for link in ("intra", "inter") if by_link[link]] or ["intra"]
    if len(crossed) == 1:
        return f"{crossed[0]}-node"
    return ", ".join(f"{_bytes(by_link[link])} {link}-node" for link in crossed)


def _axis_totals(traffic: dict[str, dict[str, int]]) -> dict[str, int]:
    """Mesh axis -> the bytes of all its collectives."""
    return {axis: sum(by.values()) for axis, by in sorted(traffic.items())}


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (shortened past 24 characters)."""
    parts, start = [], ranks[0]
    for previous, current in zip(ranks, ranks[1:] + [None]):
        if current != previous + 1 if current is not None else True:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    text = ",".join(parts)
    return text if len(text) <= 24 else text[:20] + f"..({len(ranks)})"


