"""Scale decisions from measured throughput: add a node, remove one, or hold.

Contract:

* Input, per node, over one monitoring window: samples processed and compute time (forward + backward, without
  waiting for other ranks), and for the cluster the mean optimizer-step time and the mean exposed
  communication time per step. A node's speed ``v`` is samples per second of compute, summed over its ranks.
* Model (global batch ``G`` fixed, split evenly over ``n`` nodes, synchronous steps): a step takes as long as the
  slowest node's share plus communication, ``t(n) = max_k (G / n) / v_k + s(n)``, where ring all-reduce traffic
  per rank grows as ``(n - 1) / n``, so ``s(n) = s_now * ring(n) / ring(n_now)`` (``s(1) = 0``). Throughput is
  ``G / t(n)``; the model is anchored to the measured step time (its prediction for the current cluster is
  scaled to what was measured).
* Rule (``"performance_aware"``): a node whose marginal contribution (throughput with it over throughput without
  it, minus one) is below ``threshold`` is proposed for removal (the least useful first; never below
  ``min_nodes``); otherwise, when one more node as fast as the median node is predicted to raise throughput by more
  than ``threshold``, a scale-up is proposed (never above ``max_nodes``); otherwise hold. Scaling efficiency is the
  measured throughput over the sum of the nodes' compute speeds (1.0: communication and waiting cost nothing).

No Lightning imports.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

ScalingStrategy = Literal["performance_aware"]
Action = Literal["scale_up", "scale_down", "hold"]


@dataclass(frozen=True)
class NodeWindow:
    node: int
    samples: int
    compute_seconds: float

    @property
    def speed(self) -> float:
        return self.samples / self.compute_seconds if self.compute_seconds > 0 else 0.0


@dataclass
class ScaleDecision:
    action: Action
    nodes: int
    target_nodes: int
    reason: str
    throughput: float  # samples per second, measured
    efficiency: float
    predicted_gain: Optional[float] = None  # scale-up: predicted throughput increase; scale-down: the node's marginal
    node: Optional[int] = None  # the node proposed for removal
    marginal: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def predicted_step_seconds(speeds: Sequence[float], global_batch: float, sync_now: float, nodes_now: int) -> float:
    n = len(speeds)
    compute = max(global_batch / n / v for v in speeds) if speeds and min(speeds) > 0 else float("inf")
    sync = sync_now * _ring(n) / _ring(nodes_now) if _ring(nodes_now) > 0 else 0.0
    return compute + sync


def decide(
    windows: Sequence[NodeWindow],
    step_seconds: float,
    sync_seconds: float,
    global_batch: float,
    threshold: float,
    min_nodes: int,
    max_nodes: int,
) -> ScaleDecision:
    """The rule of the module docstring, on one window of measurements."""
    n = len(windows)
    speeds = [w.speed for w in windows]
    throughput = global_batch / step_seconds if step_seconds > 0 else 0.0
    efficiency = throughput / sum(speeds) if sum(speeds) > 0 else 0.0
    modelled_now = predicted_step_seconds(speeds, global_batch, sync_seconds, n)
    anchor = step_seconds / modelled_now if modelled_now > 0 else 1.0  # what the model does not see (data, waits)

    def throughput_of(node_speeds: Sequence[float]) -> float:
        if not node_speeds:
            return 0.0
        return global_batch / (anchor * predicted_step_seconds(node_speeds, global_batch, sync_seconds, n))

    base = dict(nodes=n, throughput=throughput, efficiency=efficiency)
    marginal = {}
    if n > 1:
        for i, window in enumerate(windows):
            without = throughput_of(speeds[:i] + speeds[i + 1 :])
            marginal[window.node] = throughput / without - 1 if without > 0 else float("inf")
    if marginal and n > min_nodes:
        node, gain = min(marginal.items(), key=lambda item: item[1])
        if gain < threshold:
            return ScaleDecision(
                "scale_down", target_nodes=n - 1, node=node, predicted_gain=gain, marginal=marginal,
                reason=f"node {node} adds {gain:+.0%} throughput (< {threshold:.0%}); remove it", **base,
            )
    if n < max_nodes:
        gain = throughput_of(speeds + [statistics.median(speeds)]) / throughput - 1 if throughput > 0 else 0.0
        if gain > threshold:
            return ScaleDecision(
                "scale_up", target_nodes=n + 1, predicted_gain=gain, marginal=marginal,
                reason=f"one more node is predicted to add {gain:+.0%} throughput (> {threshold:.0%})", **base,
            )
        reason = f"one more node would add {gain:+.0%} (<= {threshold:.0%})"
    else:
        reason = f"at max_nodes={max_nodes}"
    return ScaleDecision("hold", target_nodes=n, marginal=marginal, reason=reason, **base)
