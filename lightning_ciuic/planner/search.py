"""``plan --search``: the layouts of a world size, planned one by one and ranked.

Contract: :func:`candidate_layouts` varies the degrees of a run's layout and keeps everything else (precision,
activation checkpointing, expert parallelism, compression, schedule): tensor parallel over the divisors of the world
that fit in a node (``tp <= devices_per_node``), pipeline stages over the divisors of what is left, and for the
data-parallel ranks left the three usual shapes: replicated (DDP),
sharded over all of them (FSDP), and sharded within a node, replicated across (HSDP); each sharded shape with each
ZeRO stage (``zero_stage`` 3, 2, 1: weights gathered per use or once per step, gradients reduce-scattered unit by unit
or held whole; under pipeline parallelism 1 runs as 2 and is not planned apart), unless the run's layout names one. :func:`search` plans each
(:func:`~lightning_ciuic.planner.plan_layout`), keeps the reason of those the layout's own checks refuse (heads that
tp does not divide, ...) and ranks what fits: by estimated MFU where there is a step-time estimate (the bound with
communication hidden, then the other; each rank steps the same micro-batch, so a layout with more data-parallel
ranks steps more tokens: MFU orders layouts as the whole run's tokens per second does, a step's time would not), else
by the memory the most loaded rank needs. Layouts that do not fit come after, then the refused ones.

No Lightning imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.fsdp import ZERO_STAGES
from lightning_ciuic.planner.layout import ModuleFactory, OptimizerFactory
from lightning_ciuic.planner.report import Plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    parallelism: ParallelismConfig, world_size: int, devices_per_node: int
) -> list[ParallelismConfig]:
    """The layouts :func:`search` plans (see the module docstring), each once."""
    found: dict[tuple, ParallelismConfig] = {}
    for tp in (d for d in _divisors(world_size) if d <= devices_per_node):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            within_node = devices_per_node // tp if devices_per_node % tp == 0 else 1  # tp x dp_shard: one node
            for shard in (1, dp, within_node if dp % within_node == 0 else 1):
                given = parallelism.sharding.zero_stage
                stages = ZERO_STAGES[::-1] if pp == 1 else (3, 2)  # under pipelines 1 runs as 2: planned once
                for zero in ((None,) if shard == 1 else (given,) if given is not None else stages):
                    key = (pp, tp, dp, shard, -(zero or 0))
                    found.setdefault(key, dataclasses.replace(
                        parallelism, pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp,
                        data_parallel_shard_size=shard, sharding=dataclasses.replace(parallelism.sharding, zero_stage=zero),
                    ))
    return [found[key] for key in sorted(found)]


@dataclass
class Candidate:
    """One searched layout: its plan, or why the layout's checks refused it."""

    parallelism: ParallelismConfig
    plan: Optional[Plan] = None
    refused: Optional[str] = None

    def rank_key(self) -> tuple:
        if self.plan is None:
            return (2, 0.0, 0.0)
        estimate = self.plan.estimate
        if estimate is not None:
            hidden, serial = estimate.overlapped_seconds, estimate.serial_seconds
            return (0 if self.plan.all_fit else 1, -estimate.mfu(hidden), -estimate.mfu(serial))
        return (0 if self.plan.all_fit else 1, float(self.plan.most_needed), 0.0)

    def to_json(self) -> dict[str, Any]:
        d = self.parallelism
        layout = {
            "pp": d.pipeline_parallel_size, "tp": d.tensor_parallel_size, "dp": d.data_parallel_size,
            "dp_shard": d.data_parallel_shard_size, "ep": d.expert_parallel_size, "zero_stage": d.sharding.zero_stage,
        }
        if self.plan is None:
            return {"layout": layout, "refused": self.refused}
        estimate = self.plan.estimate
        return {
            "layout": layout, "fits": self.plan.all_fit, "peak": self.plan.most_needed,
            "step_estimate": estimate.to_json() if estimate is not None else None,
        }


def search(
    build: ModuleFactory, parallelism: ParallelismConfig, world_size: int, *, optimizers: OptimizerFactory,
    devices_per_node: int = 8, step: Optional[Any] = None, **plan_options: Any,
) -> list[Candidate]:
    """Every candidate layout planned and ranked (see the module docstring); ``plan_options`` go to ``plan_layout``
    (``device_memory``, ``hardware``)."""
    from lightning_ciuic.planner import plan_layout

    candidates = []
    for layout in candidate_layouts(parallelism, world_size, devices_per_node):
        try:
            result = plan_layout(build, layout, world_size, optimizers=optimizers, step=step, **plan_options)
        except (ValueError, TypeError) as err:
            candidates.append(Candidate(layout, refused=str(err)))
            continue
        candidates.append(Candidate(layout, plan=result))
    return sorted(candidates, key=Candidate.rank_key)


def search_table(candidates: Sequence[Candidate]) -> str:
    """The ranked layouts as text, best first."""
    lines = [f"{'layout (best first)':<44} {'fits':>4} {'peak GiB':>9} {'step ms':>19} {'MFU':>13}"]
    for c in candidates:
        d = c.parallelism
        name = (
            f"pp={d.pipeline_parallel_size} tp={d.tensor_parallel_size} dp={d.data_parallel_size}"
            f" (shard {d.data_parallel_shard_size})" + (f" ep={d.expert_parallel_size}" if d.expert_parallel_size > 1 else "")
            + (f" zero{d.sharding.zero_stage}" if d.sharding.zero_stage is not None else "")
        )
        if c.plan is None:
            lines.append(f"{name:<44} refused: {c.refused}")
            continue
        peak = c.plan.most_needed / 1024**3
        estimate = c.plan.estimate
        step = mfu = "-"
        if estimate is not None:
            step = f"{estimate.overlapped_seconds * 1e3:.3g}-{estimate.serial_seconds * 1e3:.3g}"
            mfu = f"{estimate.mfu(estimate.serial_seconds):.1%}-{estimate.mfu(estimate.overlapped_seconds):.1%}"
        lines.append(f"{name:<44} {'yes' if c.plan.all_fit else 'NO':>4} {peak:>9.2f} {step:>19} {mfu:>13}")
    if not any(c.plan is not None and c.plan.estimate is not None for c in candidates):
        lines.append("ranked by the memory the most loaded rank needs (give --micro-batch-size, --sequence-length,"
                     " --flops and --link to rank by estimated MFU)")
    return "\n".join(lines)
