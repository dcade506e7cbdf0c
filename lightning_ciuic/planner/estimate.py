"""A step's time and MFU estimated from the step phase: its FLOPs against peak FLOP/s, its bytes against link speeds.

Contract: :func:`estimate_step` takes what the step phase counted on one rank (:class:`~lightning_ciuic.planner.step.
StepMemory`: the step's FLOPs and its forward's, from :mod:`~lightning_ciuic.planner.flops`; the bytes sent per mesh axis and
the global ranks of each axis's group) and a :class:`Hardware`, and returns a :class:`StepEstimate`:

* compute: the step's FLOPs (recomputed forwards included: the device runs them) over ``peak_flops`` times the
  kernels' achieved ``efficiency`` (the fraction of the peak a training step's kernels reach: a default fitted on
  published runs, :mod:`~lightning_ciuic.planner.efficiency`, overridable per device), the FP8 GEMMs' FLOPs
  (``fp8_flops``, ``gemm_precision="fp8"``) at ``fp8_speedup`` times that rate (what FP8 GEMMs achieve against the
  same GEMMs in bf16: a default fitted on published runs there too);
* communication, per axis, its bytes on each link (:func:`link_bytes`): all on the intra-node link when every rank
  of its group sits on one node (``rank // devices_per_node`` equal, nodes holding consecutive ranks as torchrun
  places them); for a group over several nodes, an all-to-all's bytes split by where they go (the share of the
  group's other ranks on the sender's node crosses the intra-node link, the rest the inter-node one: exact for the
  plan's even routing), and a ring collective's (all-gather, reduce-scatter, all-reduce, broadcast, send) all on
  the inter-node link, its bottleneck. An axis takes the longer of its two links' times (they run side by side),
  plus its collectives' calls times the hardware's per-collective ``latency`` (default 0: not modelled; an
  alpha-beta model, fitted per cluster); the axes' seconds add up (one rank's collectives queue on its links one
  after another);
* the step between two bounds: ``max(compute, communication)`` (every collective hidden behind compute, as FSDP2's
  prefetching and bucketed all-reduces aim for) and ``compute + communication`` (none hidden), each over
  ``1 - bubble`` for a pipeline rank (``bubble``: the fraction of the step the schedule leaves it idle);
* between them, the modelled step, ``max(compute + exposed, communication) / (1 - bubble)``: the expert all-to-alls
  (every axis's all-to-all bytes: the dispatch's, whichever axis its group is, ``ep``, ``ep_node``, ``ep_local``, or
  ``dp`` where ep spans the data-parallel ranks) sit on the compute's path, since a mixture-of-experts layer waits
  for its tokens, and the other axes' collectives run beside the compute as their engines schedule them (hidden up
  to the links' own time). ``exposed`` is the expert all-to-alls' seconds ``E``, all of them without ``expert_overlap``; with it
  (``expert_dispatch_overlap``: :data:`~lightning_ciuic.parallel.experts.overlap.CHUNKS` chunks per micro-batch, one
  chunk's all-to-alls in flight while another's experts compute) ``E - min(E (1 - 1/CHUNKS), C)``: the first chunk's
  dispatch and the last chunk's combine of each layer have nothing to hide behind (half of ``E`` with two chunks),
  the others hide behind the other chunks' experts' compute ``C`` (``experts_flops``: the FLOPs run inside the packed
  experts' modules, at the step's mean rate) up to its length; under DualPipeV the share ``q`` of the rank's forwards
  and backwards that run in forward-backward pairs (``paired``:
  :func:`~lightning_ciuic.parallel.schedule_bubble.paired_fraction`) runs its all-to-alls as one flow in flight while
  the pair's other micro-batch computes (:mod:`~lightning_ciuic.parallel.paired_overlap`): ``q E`` hides behind
  ``q`` of the whole compute ``K`` up to its length (``q max(0, E - K)`` exposed), the rest ``(1 - q) E`` as two
  chunks, behind ``(1 - q) C``;
* MFU for both: model FLOPs over the step's time times ``peak_flops``, model FLOPs being three times the forward's
  (backward costs two forwards; recomputation is not counted, the convention of PaLM's appendix B).

What it leaves out, and says so in the plan: kernel efficiency other than the one given (it differs between
devices, power limits and compilers: the fit's figures are in docs/plan.md), latency other than the one given, links
shared by the axes of several ranks of a node, and stages of unequal speed beyond the bubble given.

No Lightning imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from lightning_ciuic.parallel.experts.overlap import CHUNKS
from lightning_ciuic.planner.efficiency import FP8_SPEEDUP, KERNEL_EFFICIENCY

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}
_BINARY = {"": 1.0, "k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40, "p": 2.0**50}


def parse_flops(text: str) -> float:
    """``"989e12"``, ``"989T"``, ``"989 TFLOPS"`` or ``"1.98P"`` as FLOP/s."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgtpe]?)(?:flop/?s|flops)?\s*", text, re.I)
    if match is None:
        raise ValueError(f"{text!r} is not a FLOP/s figure: write it as 989e12, 989T or 989TFLOPS (per device).")
    number, prefix = match.groups()
    return float(number) * _SI[prefix.lower()]


def parse_rate(text: str) -> float:
    """``"900GB/s"``, ``"400Gbit/s"``, ``"50GiB/s"`` (also ``Gb/s``, ``Gbps``) as bytes per second."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgtp]?)(i?)(b|bit|byte)s?(?:/s|ps)\s*", text, re.I)
    if match is None:
        raise ValueError(
            f"{text!r} is not a link speed: write it as 900GB/s (bytes), 400Gbit/s or 400Gbps (bits), 50GiB/s."
        )
    number, prefix, binary, unit = match.groups()
    scale = (_BINARY if binary else _SI)[prefix.lower()]
    bits = unit == "b" or unit.lower() == "bit"  # "Gb/s": bits, "GB/s": bytes
    return float(number) * scale / (8 if bits else 1)


def parse_seconds(text: str) -> float:
    """``"20us"``, ``"3.5ms"``, ``"0.002s"`` or ``"0.002"`` as seconds."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*(us|ms|s)?\s*", text, re.I)
    if match is None:
        raise ValueError(f"{text!r} is not a duration: write it as 20us, 3.5ms or 0.002s.")
    number, unit = match.groups()
    return float(number) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[unit.lower() if unit else None]


def parse_links(text: str) -> tuple[float, float]:
    """``"intra=900GB/s,inter=50GB/s"`` as (intra-node, inter-node) bytes per second."""
    links = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in ("intra", "inter") or not value:
            raise ValueError(f"--link {text!r}: write it as intra=900GB/s,inter=50GB/s (both, per device).")
        links[name.strip()] = parse_rate(value)
    if set(links) != {"intra", "inter"}:
        raise ValueError(f"--link {text!r} names {sorted(links)}; give both: intra=900GB/s,inter=50GB/s.")
    return links["intra"], links["inter"]


@dataclass(frozen=True)
class Hardware:
    """One device's peak FLOP/s, its links' speeds (bytes per second, each way), how many devices a node holds, the
    fraction of the peak its kernels reach in a training step (``efficiency``, in (0, 1]), the seconds each
    collective call costs besides its bytes (``latency``, >= 0; 0: not modelled) and how many times faster its FP8
    GEMMs run than the same in bf16 (``fp8_speedup``, > 0)."""

    peak_flops: float
    intra_node: float
    inter_node: float
    devices_per_node: int = 8
    efficiency: float = KERNEL_EFFICIENCY
    latency: float = 0.0
    fp8_speedup: float = FP8_SPEEDUP

    def __post_init__(self) -> None:
        if not self.latency >= 0:
            raise ValueError(f"latency is the seconds a collective call costs besides its bytes, >= 0; got {self.latency!r}.")
        for name in ("peak_flops", "intra_node", "inter_node", "devices_per_node", "efficiency", "fp8_speedup"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        if self.efficiency > 1:
            raise ValueError(
                f"efficiency is the fraction of the peak FLOP/s kernels reach, at most 1; got {self.efficiency!r}"
                f" (the default, fitted on published runs, is {KERNEL_EFFICIENCY:.2f})."
            )

    def link_of(self, ranks: Sequence[int]) -> str:
        """``"intra"`` when the ranks sit on one node, else ``"inter"``."""
        return "intra" if len({r // self.devices_per_node for r in ranks}) <= 1 else "inter"

    def speed(self, link: str) -> float:
        return self.intra_node if link == "intra" else self.inter_node

    def local_share(self, ranks: Sequence[int]) -> float:
        """The share of a group member's peers on its own node, averaged over the members."""
        if len(ranks) < 2:
            return 1.0
        nodes = [r // self.devices_per_node for r in ranks]
        return sum(nodes.count(node) - 1 for node in nodes) / (len(nodes) * (len(nodes) - 1))


def link_bytes(collectives: Mapping[str, int], ranks: Sequence[int], hardware: Hardware) -> dict[str, int]:
    """One axis's bytes per link, ``{"intra": ..., "inter": ...}`` (see the module docstring)."""
    if hardware.link_of(ranks) == "intra":
        return {"intra": sum(collectives.values()), "inter": 0}
    to_all = collectives.get("all_to_all", 0)
    local = round(to_all * hardware.local_share(ranks))
    return {"intra": local, "inter": sum(collectives.values()) - local}


@dataclass(frozen=True)
class StepEstimate:
    """What :func:`estimate_step` found (see the module docstring); seconds, FLOPs, fractions."""

    flops: int  # counted in the step, recompute included
    model_flops: int  # three forwards
    compute_seconds: float
    axis_seconds: Mapping[str, float]
    axis_link_bytes: Mapping[str, Mapping[str, int]]  # axis -> {"intra": bytes, "inter": bytes}
    peak_flops: float
    expert_seconds: float = 0.0  # of the axes' seconds, their all-to-alls' (the expert dispatch's)
    bubble: float = 0.0  # the fraction of the step a pipeline schedule leaves the rank idle
    efficiency: float = 1.0  # the fraction of the peak the kernels reach (compute_seconds has it)
    experts_compute_seconds: float = 0.0  # of compute_seconds, the packed experts'
    expert_overlap: bool = False  # CHUNKS chunks per micro-batch: an all-to-all hides behind another chunk's experts
    fp8_flops: int = 0  # of flops, the FP8 GEMMs' (compute_seconds times them at fp8_speedup)
    fp8_speedup: float = 1.0
    paired: float = 0.0  # with expert_overlap, the share of the expert all-to-alls in DualPipeV's forward-backward pairs

    @property
    def axis_links(self) -> dict[str, str]:
        """axis -> ``"intra"``, ``"inter"`` or ``"intra+inter"``: the links its bytes cross."""
        return {
            axis: "+".join(link for link in ("intra", "inter") if by[link]) or "intra"
            for axis, by in self.axis_link_bytes.items()
        }

    @property
    def communication_seconds(self) -> float:
        return sum(self.axis_seconds.values())

    @property
    def overlapped_seconds(self) -> float:
        return max(self.compute_seconds, self.communication_seconds) / (1 - self.bubble)

    @property
    def serial_seconds(self) -> float:
        return (self.compute_seconds + self.communication_seconds) / (1 - self.bubble)

    @property
    def exposed_expert_seconds(self) -> float:
        """What of the expert all-to-alls the compute waits for: all without ``expert_overlap``, else the first
        chunk's dispatch and the last chunk's combine, and what the other chunks' experts' compute does not hide."""
        if not self.expert_overlap:
            return self.expert_seconds
        q = self.paired
        in_pairs = q * max(0.0, self.expert_seconds - self.compute_seconds)
        chunked, experts = (1 - q) * self.expert_seconds, (1 - q) * self.experts_compute_seconds
        return in_pairs + chunked - min(chunked * (1 - 1 / CHUNKS), experts)

    @property
    def modelled_seconds(self) -> float:
        """The modelled step (see the module docstring), between :attr:`overlapped_seconds` and :attr:`serial_seconds`."""
        busy = max(self.compute_seconds + self.exposed_expert_seconds, self.communication_seconds)
        return busy / (1 - self.bubble)

    def mfu(self, seconds: float) -> float:
        return self.model_flops / (seconds * self.peak_flops) if seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "flops": self.flops, "model_flops": self.model_flops, "compute_seconds": self.compute_seconds, "bubble": self.bubble,
            "efficiency": self.efficiency, "fp8_flops": self.fp8_flops, "fp8_speedup": self.fp8_speedup,
            "communication_seconds": dict(self.axis_seconds), "links": self.axis_links,
            "link_bytes": {axis: dict(by) for axis, by in self.axis_link_bytes.items()},
            "experts_compute_seconds": self.experts_compute_seconds, "expert_overlap": self.expert_overlap, "paired": self.paired,
            "expert_seconds": self.expert_seconds, "exposed_expert_seconds": self.exposed_expert_seconds,
            "step_seconds": {"overlapped": self.overlapped_seconds, "modelled": self.modelled_seconds, "serial": self.serial_seconds},
            "mfu": {
                "overlapped": self.mfu(self.overlapped_seconds), "modelled": self.mfu(self.modelled_seconds),
                "serial": self.mfu(self.serial_seconds),
            },
        }


def estimate_step(
    flops: int, forward_flops: int, traffic: Mapping[str, Mapping[str, int]], axis_ranks: Mapping[str, Sequence[int]],
    hardware: Hardware, bubble: float = 0.0, experts_flops: float = 0.0, expert_overlap: bool = False,
    calls: Optional[Mapping[str, Mapping[str, int]]] = None, fp8_flops: int = 0, paired: float = 0.0,
) -> StepEstimate:
    """The estimate of one rank's step (see the module docstring); ``traffic``: bytes per axis and collective;
    ``experts_flops``: of ``flops``, the packed experts'; ``expert_overlap``: the dispatch's chunks; ``calls``: the
    collectives' calls per axis and collective (each costs ``hardware.latency``); ``fp8_flops``: of ``flops``, the FP8
    GEMMs'; ``paired``: with ``expert_overlap``, the share of the rank's passes in DualPipeV's forward-backward pairs."""
    calls = calls or {}
    by_link = {axis: link_bytes(collectives, axis_ranks.get(axis, ()), hardware) for axis, collectives in traffic.items()}
    latency = {axis: hardware.latency * sum(calls.get(axis, {}).values()) for axis in traffic}
    seconds = {axis: _seconds(by, hardware) + latency[axis] for axis, by in by_link.items()}
    to_all = {axis: {"all_to_all": c["all_to_all"]} for axis, c in traffic.items() if c.get("all_to_all")}
    expert = sum(
        _seconds(link_bytes(c, axis_ranks.get(axis, ()), hardware), hardware)
        + hardware.latency * calls.get(axis, {}).get("all_to_all", 0)
        for axis, c in to_all.items()
    )
    rate = hardware.peak_flops * hardware.efficiency
    compute = (flops - fp8_flops) / rate + fp8_flops / (rate * hardware.fp8_speedup)
    return StepEstimate(
        flops=int(flops), model_flops=int(3 * forward_flops), compute_seconds=compute,
        axis_seconds=seconds, axis_link_bytes=by_link, peak_flops=hardware.peak_flops, expert_seconds=expert, bubble=bubble,
        efficiency=hardware.efficiency, experts_compute_seconds=compute * min(experts_flops, flops) / flops if flops else 0.0,
        expert_overlap=expert_overlap, fp8_flops=int(fp8_flops), fp8_speedup=hardware.fp8_speedup, paired=paired,
    )


def _seconds(by_link: Mapping[str, int], hardware: Hardware) -> float:
    """The longer of an axis's two links' times (they run side by side)."""
    return max(n / hardware.speed(link) for link, n in by_link.items())
