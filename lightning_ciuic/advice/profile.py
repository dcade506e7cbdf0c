"""RunProfile: what a run measured, per rank, in the form the advisor and the report read.

Contract: per-rank mean seconds (and bytes) per training step over a run (:data:`RANK_FIELDS`), the layout, the
link and codec measurements predictions need; ``to_json`` / ``from_json`` round-trip it through ``monitor.json``
(written by :class:`~lightning_ciuic.callbacks.monitor.CommunicationMonitor`). :func:`format_rate` is the one
way the report and the console write a rate (bytes per second): in GB/s (10^9 bytes per second), the unit the
advice text uses too, so one link speed never appears in two units. No Lightning imports.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

RANK_FIELDS = (
    "step", "compute", "data_wait", "dp_exposed", "dp_comm", "dp_bytes", "dp_payload", "tp_comm", "memory_mb",
    "dp_gather", "dp_scatter",  # sharded data parallelism: parameter all-gathers, gradient reduce-scatters (in dp_comm)
    "pp_bubble",  # pipeline parallel: the schedule's idle time (in compute)
    "checkpoint_stall", "snapshot_stall", "outer_sync",  # training stopped for a checkpoint's staging, a snapshot, a DiLoCo sync
    "ep_bytes", "ep_tokens",  # expert parallelism: bytes this rank sent in the token all-to-alls, tokens its experts ran
    "ep_comm",  # and the seconds those all-to-alls took (waiting for busier ranks included)
    "ep_inter_bytes",  # of ep_bytes, those that crossed the inter-node link
    "ep_exposed",  # of ep_comm, the time the training thread was blocked on them (all of it without expert_dispatch_overlap)
)

RATE_UNIT = "GB/s"  # 10^9 bytes per second: every rate the report and the console print


def format_rate(bytes_per_second: float) -> str:
    """A rate in :data:`RATE_UNIT`, three significant digits in fixed notation ("0.349 GB/s", "0.00215 GB/s",
    "12.5 GB/s", "1250 GB/s")."""
    value = bytes_per_second / 1e9
    if value <= 0 or not math.isfinite(value):
        return f"{max(value, 0.0):g} {RATE_UNIT}"
    decimals = max(0, 2 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f} {RATE_UNIT}"


@dataclass
class RunProfile:
    """Per-rank mean seconds (and bytes) per training step over a run, with what predictions need.
    ``step`` is the whole period of a step on that rank: data wait + the training batch."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    compression: str = "none"
    gradient_numel: int = 0
    buckets: int = 1
    latency_s: Optional[float] = None
    bandwidth_bytes_per_s: Optional[float] = None
    codec_s_per_value: dict[str, float] = field(default_factory=dict)
    sync_s: dict[str, float] = field(default_factory=dict)  # measured per mode on an idle machine (preferred)
    ranks: list[dict[str, float]] = field(default_factory=list)  # one dict of RANK_FIELDS per global rank
    dp_rank_of: list[int] = field(default_factory=list)  # global rank -> dp rank
    bubble: Optional[float] = None
    num_microbatches: Optional[int] = None
    dp_shard: int = 1
    model_state_mb: Optional[float] = None  # parameters + gradients + optimizer state one rank holds (rank 0's)
    memory_capacity_mb: Optional[float] = None  # per rank: the GPU's memory, or the host's RAM / local processes
    ep: int = 1
    expert_load: dict[str, float] = field(default_factory=dict)  # MoE layer -> max / mean tokens per expert (all ranks)
    pp_rank_of: list[int] = field(default_factory=list)  # global rank -> pipeline rank (empty: unknown, one stage)
    expert_balancer_rate: Optional[float] = None  # an ExpertLoadBalancer's bias_update_rate (None: none in the run)

    def mean(self, key: str) -> float:
        return statistics.fmean(r[key] for r in self.ranks) if self.ranks else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunProfile":
        """Also reads the ``monitor.json`` of earlier versions (fields they lacked are zero or unknown)."""
        ranks = [{key: rank.get(key, 0.0) for key in RANK_FIELDS} for rank in data.get("ranks", [])]
        return cls(**{**data, "ranks": ranks})
