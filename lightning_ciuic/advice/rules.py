"""The advisor's rules: turns a run's measurements into concrete changes, each with a predicted speed-up.

Contract: :func:`advise` takes a :class:`RunProfile` (what :class:`~lightning_ciuic.callbacks.monitor.CommunicationMonitor`
measured, also stored as ``monitor.json`` so ``lightning-ciuic advise RUN_DIR`` gives the same advice offline)
and returns :class:`Advice` items, largest predicted speed-up first, only for changes predicted to gain at
least ``min_speedup`` (10%): a healthy run gets no advice. Rules, each on per-rank means over the run:

* **gradient compression** (data parallel, uncompressed or 16-bit): each dense mode's synchronization work
  (:func:`~lightning_ciuic.comm.auto.predicted_sync_seconds`: link latency and bandwidth measured at start, codec
  speed of this machine) minus what the run shows backward can absorb (see :func:`compression_speedups`) is
  its predicted exposed time. Advises ``communication_compression: <mode>``.
* **straggler**: a data-parallel replica whose compute per step is ``1 + straggler_threshold`` times the median
  of the other replicas or more (its slowest tensor-parallel rank counts); balanced
  shares would make every rank finish in ``dp / sum(1 / compute_r)``. Advises ``DynamicDataBalancer``.
* **data loading**: waiting for batches above 10% of the step; advises more DataLoader workers (predicted:
  the wait removed).
* **pipeline bubble** (pipeline parallel): measured idle fraction above 20%; advises doubling
  ``num_microbatches`` (predicted from the schedule's ``(p-1)/(m+p-1)``).
* **DiLoCo** (replicated data parallel, per-step synchronization): when even the best per-step compression leaves a
  step at least ``1.25x`` slower than DiLoCo(``sync_every=32``) is predicted to be
  (:func:`~lightning_ciuic.comm.auto.predicted_diloco_step_seconds`: the exposed sync removed, one uncompressed sync of
  the model, ``U(none)``, every 32 steps) and DiLoCo's gain is 1.1x the best compression's or more. It changes the
  optimisation (the advice says so, with the loss measured in ``benchmarks/diloco.py``): advice, never a switch.
* **sharding** (replicated data parallel): peak memory at 80% of what a rank has (GPU memory, or the host's RAM
  per process) or more; advises ``data_parallel_shard_size=dp`` with the memory it predicts freed per rank (the
  parameters, gradients and optimizer state it holds, less a 1/dp share of them) and the all-gather traffic it
  adds. It is a memory advice (``predicted_memory_mb``), listed whatever its speed.

* **expert balance** (mixture-of-experts layers): max / mean tokens per expert of the worst layer over the run, and
  under expert parallelism the tokens each rank's experts ran (max / mean over ranks: the busiest rank sets the
  pace), and each rank's time in the token all-to-alls (``ep_comm``: a rank with fewer tokens waits there for the
  busiest). Advises ``ExpertLoadBalancer`` when a layer is at 1.5 or more; when the ranks' all-to-all times differ by
  5% of the step or more, it is advice predicting ``step / (step - (max - min))``: the least busy rank's wait
  removed, an upper bound; else a finding without a prediction.

The compression rule models an all-reduce: it is skipped for sharded runs (reduce-scatters and all-gathers).

:func:`check` returns every rule's :class:`Finding`: what it measured against its threshold, in one line, and its
advice if any (the report lists them, so "no advice" says what was checked); :func:`advise` keeps the advice.

No Lightning imports.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from lightning_ciuic.advice.profile import RunProfile
from lightning_ciuic.comm.auto import CANDIDATES, DILOCO_PAYS, DILOCO_SYNC_EVERY, predicted_diloco_step_seconds, predicted_sync_seconds


@dataclass(frozen=True)
class Advice:
    summary: str  # one line a person reads first
    argument: str  # the exact Trainer / YAML change
    predicted_speedup: float
    rule: str
    predicted_memory_mb: Optional[float] = None  # a memory advice: megabytes freed per rank

    @property
    def prediction(self) -> str:
        if self.predicted_memory_mb is not None:
            return f"predicted {self.predicted_memory_mb:.0f} MB less memory per rank"
        return f"predicted {self.predicted_speedup:.2f}x step throughput"

    def __str__(self) -> str:
        return f"{self.summary}\n    change: {self.argument}  ({self.prediction})"


@dataclass(frozen=True)
class Finding:
    rule: str
    checked: str  # what was measured against what threshold, or why the rule does not apply
    advice: Optional[Advice] = None


def check(profile: RunProfile, min_speedup: float = 1.10, straggler_threshold: float = 0.15) -> list[Finding]:
    """Every rule's finding; advice below ``min_speedup`` (and not a memory advice) is dropped from its finding."""
    findings = [
        _compression(profile, min_speedup),
        _straggler(profile, straggler_threshold),
        _data_loading(profile),
        _bubble(profile),
        _sharding(profile),
        _diloco(profile),
        _expert_balance(profile),
    ]
    return [
        f if f.advice is None or f.advice.predicted_speedup >= min_speedup or f.advice.predicted_memory_mb else Finding(f.rule, f.checked)
        for f in findings
    ]


def _expert_balance(profile: RunProfile, advised: float = 1.5) -> Finding:
    rule = "expert balance"
    if not profile.expert_load:
        return Finding(rule, "not checked: no mixture-of-experts layer (packed experts)")
    layer, worst = max(profile.expert_load.items(), key=lambda item: item[1])
    tokens = _by_stage(profile, [r["ep_tokens"] for r in profile.ranks])
    ranked = [max(t) / statistics.fmean(t) for t in tokens.values() if statistics.fmean(t) > 0]
    ranks = f"; ranks' experts ran max/mean {max(ranked):.2f}x the tokens" if profile.ep > 1 and ranked else ""
    checked = f"tokens per expert max/mean {worst:.2f} in {layer} (advised at {advised} or more){ranks}"
    waited = _imbalance_wait(profile)
    if waited is not None:
        every = [seconds for stage in waited.values() for seconds in stage]
        checked += (
            f"; all-to-alls {min(every) * 1e3:.1f}-{max(every) * 1e3:.1f} ms per step over the ranks (the busiest"
            " waits least" + (", compared within each pipeline stage)" if len(waited) > 1 else ")")
        )
    if worst < advised:
        return Finding(rule, checked)
    rate = profile.expert_balancer_rate
    if rate is None:
        change, argument = "add ExpertLoadBalancer", "callbacks: [ExpertLoadBalancer()]  (lightning_ciuic.ExpertLoadBalancer)"
    else:  # on already: its bias moves too slowly for this run
        change = f"ExpertLoadBalancer is on (bias_update_rate={rate:g}): raise its rate, or train longer"
        argument = f"callbacks: [ExpertLoadBalancer(bias_update_rate={max(10 * rate, 1e-3):g})]  (lightning_ciuic.ExpertLoadBalancer)"
    checked += f"; {change} (auxiliary-loss-free routing bias, docs/expert_parallel.md)"
    step = profile.mean("step")
    spread = _imbalance_spread(waited) if waited is not None else 0.0
    if spread < 0.05 * step or step <= 0:
        return Finding(rule, checked)  # the imbalance costs no measurable time: a finding, no speed-up predicted
    return Finding(rule, checked, Advice(
        f"experts are unbalanced: ranks wait up to {spread * 1e3:.1f} ms per step in the token all-to-alls for the"
        " busiest rank's experts" + ("" if rate is None else f" (ExpertLoadBalancer on, bias_update_rate={rate:g})"),
        argument, step / (step - spread), rule,
    ))


def _imbalance_wait(profile: RunProfile) -> Optional[dict[int, list[float]]]:
    """Each rank's seconds per step in the token all-to-alls, by pipeline rank (ranks of different stages run
    different layers), where expert parallelism measured them."""
    waited = [r["ep_comm"] for r in profile.ranks]
    if profile.ep <= 1 or not waited or max(waited) <= 0:
        return None
    return _by_stage(profile, waited)


def _by_stage(profile: RunProfile, values: list[float]) -> dict[int, list[float]]:
    """Per-rank values grouped by pipeline rank (one group where the profile does not know the ranks' stages)."""
    stages = profile.pp_rank_of if len(profile.pp_rank_of) == len(values) else [0] * len(values)
    grouped: dict[int, list[float]] = {}
    for stage, value in zip(stages, values):
        grouped.setdefault(stage, []).append(value)
    return grouped


def _imbalance_spread(waited: dict[int, list[float]]) -> float:
    """What the least busy rank of a pipeline stage waited for its busiest, at most, over the stages."""
    return max(max(seconds) - min(seconds) for seconds in waited.values())


def advise(profile: RunProfile, min_speedup: float = 1.10, straggler_threshold: float = 0.15) -> list[Advice]:
    """The advice of :func:`check`, largest predicted speed-up first."""
    found = [f.advice for f in check(profile, min_speedup, straggler_threshold) if f.advice is not None]
    return sorted(found, key=lambda a: -a.predicted_speedup)


def compression_speedups(profile: RunProfile) -> dict[str, float]:
    """Predicted step-throughput ratio of each dense compression mode against the measured run.

    ``U(mode)`` is the time to synchronize one step's gradient: measured through the real reducer while the
    machine computes, at the start of training, when available (``sync_s``); else predicted from latency, wire
    bytes over the measured bandwidth and this machine's codec time (:func:`predicted_sync_seconds`). The run
    shows how much of the current mode's synchronization backward hid: ``U(current) - exposed``. A mode's
    exposed time is what its ``U`` leaves after that same hidden amount; if the run was slower than ``U``
    predicts, every ``U`` is scaled up by the same factor."""
    work = _sync_work(profile)
    step, exposed = profile.mean("step"), profile.mean("dp_exposed")
    if work is None or step <= 0:
        return {}
    current = work(profile.compression)
    scale = max(1.0, exposed / current) if current > 0 else 1.0
    absorbed = max(0.0, current * scale - exposed)
    return {
        mode: step / max(step - exposed + max(0.0, work(mode) * scale - absorbed), 1e-9) for mode in CANDIDATES
    }


def _sync_work(profile: RunProfile) -> Optional[Callable[[str], float]]:
    """``U(mode)``: seconds to synchronize one step's gradient in ``mode``, measured at start or predicted."""
    if profile.dp < 2 or not profile.bandwidth_bytes_per_s or not profile.gradient_numel:
        return None

    def work(mode: str) -> float:
        if mode in profile.sync_s:
            return profile.sync_s[mode]
        return predicted_sync_seconds(
            mode, profile.gradient_numel, profile.buckets, profile.dp, profile.latency_s or 0.0,
            profile.bandwidth_bytes_per_s, profile.codec_s_per_value.get(mode, 0.0),
        )

    return work


def _compression(profile: RunProfile, min_speedup: float) -> Finding:
    rule = "gradient compression"
    if profile.dp_shard > 1:
        return Finding(rule, "not checked: sharded data parallelism (reduce-scatters and all-gathers, not an all-reduce)")
    if profile.compression not in ("none", "fp16", "bf16"):
        return Finding(rule, f"not checked: the run already uses {profile.compression!r}")
    speedups = compression_speedups(profile)
    if not speedups:
        return Finding(rule, "not checked: needs data parallelism (dp >= 2) and the link measured at start (measure_link)")
    mode = max(speedups, key=speedups.get)
    step, exposed, comm = profile.mean("step"), profile.mean("dp_exposed"), profile.mean("dp_comm")
    checked = (
        f"gradient sync exposed {exposed / step:.0%} of the step; best mode {mode!r} predicted {speedups[mode]:.2f}x"
        f" (advised from {min_speedup:.2f}x)"
    )
    if mode == profile.compression:
        return Finding(rule, checked)
    algbw = profile.mean("dp_payload") / comm / 1e9 if comm > 0 else 0.0
    return Finding(rule, checked, Advice(
        f"gradient sync is {exposed / step:.0%} of the step (exposed; {comm * 1e3:.0f} ms in all) at {algbw:.2f} GB/s:"
        f" communication_compression={mode!r} is predicted {speedups[mode]:.2f}x faster",
        f"strategy.communication_compression: {mode}   (Trainer(strategy=HybridParallelStrategy(communication_compression={mode!r})))",
        speedups[mode],
        "compression",
    ))


def _straggler(profile: RunProfile, threshold: float) -> Finding:
    rule = "straggler"
    if profile.dp < 2 or not profile.ranks:
        return Finding(rule, "not checked: needs data parallelism (dp >= 2)")
    per_dp: dict[int, float] = {}
    for rank, values in enumerate(profile.ranks):
        dp_rank = profile.dp_rank_of[rank] if profile.dp_rank_of else rank
        per_dp[dp_rank] = max(per_dp.get(dp_rank, 0.0), values["compute"])
    computes = list(per_dp.values())
    slow_dp = max(per_dp, key=per_dp.get)
    slowest = per_dp[slow_dp]
    median = statistics.median(c for r, c in per_dp.items() if r != slow_dp)  # of the other replicas
    checked = f"slowest replica's compute {slowest / median if median > 0 else 1.0:.2f}x the others' median (advised from {1 + threshold:.2f}x)"
    if median <= 0 or slowest < (1 + threshold) * median:
        return Finding(rule, checked)
    ranks = [r for r in range(len(profile.ranks)) if (profile.dp_rank_of[r] if profile.dp_rank_of else r) == slow_dp]
    balanced = len(computes) / sum(1.0 / c for c in computes)
    step = profile.mean("step")
    speedup = step / max(step - (slowest - balanced), 1e-9)
    return Finding(rule, checked, Advice(
        f"rank {', '.join(map(str, ranks))} is {slowest / median:.2f}x slower than the others (compute"
        f" {slowest * 1e3:.0f} ms vs {median * 1e3:.0f} ms per step): add DynamicDataBalancer",
        "trainer.callbacks: - class_path: lightning_ciuic.DynamicDataBalancer   (callbacks=[DynamicDataBalancer()])",
        speedup,
        "straggler",
    ))


def _data_loading(profile: RunProfile) -> Finding:
    step, wait = profile.mean("step"), profile.mean("data_wait")
    checked = f"waiting for data {wait / step if step > 0 else 0.0:.0%} of the step (advised above 10%)"
    if step <= 0 or wait / step <= 0.10:
        return Finding("data loading", checked)
    return Finding("data loading", checked, Advice(
        f"waiting for data is {wait / step:.0%} of each step ({wait * 1e3:.0f} ms): load batches in"
        " background workers",
        "DataLoader(num_workers=<2 or more>, persistent_workers=True)",
        step / max(step - wait, 1e-9),
        "data",
    ))


def _bubble(profile: RunProfile) -> Finding:
    rule = "pipeline bubble"
    if profile.pp < 2 or profile.bubble is None or not profile.num_microbatches:
        return Finding(rule, "not checked: no pipeline parallelism")
    checked = f"pipeline bubble {profile.bubble:.0%} of the step (advised above 20%)"
    if profile.bubble <= 0.20:
        return Finding(rule, checked)
    p, m = profile.pp, profile.num_microbatches
    new_bubble = (p - 1) / (2 * m + p - 1)
    speedup = (1 - new_bubble) / (1 - profile.bubble)
    return Finding(rule, checked, Advice(
        f"pipeline bubble is {profile.bubble:.0%} of the step: raise num_microbatches to {2 * m}",
        f"strategy.num_microbatches: {2 * m}",
        speedup,
        "bubble",
    ))


def _sharding(profile: RunProfile, tight: float = 0.80) -> Finding:
    rule = "sharding"
    if profile.dp_shard > 1:
        return Finding(rule, f"not checked: already sharded (dp_shard={profile.dp_shard})")
    if profile.dp < 2 or not profile.ranks or not profile.memory_capacity_mb or not profile.model_state_mb:
        return Finding(rule, "not checked: needs data parallelism (dp >= 2) and the memory a rank has")
    peak, capacity, state = max(r["memory_mb"] for r in profile.ranks), profile.memory_capacity_mb, profile.model_state_mb
    checked = f"peak memory {peak:.0f} MB of the {capacity:.0f} MB a rank has, {peak / capacity:.0%} (advised from {tight:.0%})"
    if peak < tight * capacity:
        return Finding(rule, checked)
    freed = state * (1 - 1 / profile.dp)
    # FSDP gathers every parameter for forward and again for backward: 2 (dp-1)/dp of the parameters per step, in
    # place of nothing (a replicated run gathers none); the gradient reduce-scatter costs half an all-reduce.
    gathered_mb = 2 * (profile.dp - 1) / profile.dp * profile.gradient_numel * 4 / 2**20
    return Finding(rule, checked, Advice(
        f"memory is tight: peak {peak:.0f} MB of the {capacity:.0f} MB a rank has; sharding the {state:.0f} MB of"
        f" parameters, gradients and optimizer state over the {profile.dp} data-parallel ranks (FSDP) frees about"
        f" {freed:.0f} MB per rank, for about {gathered_mb:.0f} MB more traffic per step (parameter all-gathers)",
        f"strategy.data_parallel_shard_size: {profile.dp}   (HybridParallelStrategy(data_parallel_shard_size={profile.dp}))",
        1.0,
        "sharding",
        predicted_memory_mb=freed,
    ))


def _diloco(profile: RunProfile) -> Finding:
    rule = "DiLoCo"
    if profile.compression.startswith("diloco"):
        return Finding(rule, f"not checked: the run already uses DiLoCo ({profile.compression})")
    if profile.dp_shard > 1:
        return Finding(rule, "not checked: sharded data parallelism")
    work = _sync_work(profile)
    step, exposed = profile.mean("step"), profile.mean("dp_exposed")
    if work is None or step <= 0:
        return Finding(rule, "not checked: needs data parallelism (dp >= 2) and the link measured at start (measure_link)")
    best_mode, best = max(compression_speedups(profile).items(), key=lambda kv: kv[1])
    diloco = step / max(predicted_diloco_step_seconds(step, exposed, work("none"), DILOCO_SYNC_EVERY), 1e-9)
    checked = (
        f"DiLoCo(sync_every={DILOCO_SYNC_EVERY}) predicted {diloco:.2f}x, best per-step compression {best_mode!r}"
        f" {best:.2f}x (advised from {DILOCO_PAYS:.2f}x and 1.1x the compression's gain)"
    )
    if diloco < DILOCO_PAYS or diloco < 1.1 * best:
        return Finding(rule, checked)
    return Finding(rule, checked, Advice(
        f"gradient sync is {exposed / step:.0%} of the step and the best per-step compression ({best_mode!r}) is"
        f" predicted only {best:.2f}x: DiLoCo, synchronizing every {DILOCO_SYNC_EVERY} steps, is predicted"
        f" {diloco:.2f}x. It changes the optimisation (benchmarks/diloco.py, 1000 steps at equal tokens: validation"
        " loss within 1% of per-step data parallelism's with plain outer averaging, outer_lr 1.0 and outer_momentum"
        " 0.0, as suggested here; 7% to 12% higher with the paper's Nesterov defaults): try it on a short run first",
        f"strategy.diloco: {{class_path: lightning_ciuic.DiLoCo, init_args: {{sync_every: {DILOCO_SYNC_EVERY},"
        f" outer_lr: 1.0, outer_momentum: 0.0}}}}   (HybridParallelStrategy(diloco=DiLoCo(sync_every={DILOCO_SYNC_EVERY},"
        " outer_lr=1.0, outer_momentum=0.0)))",
        diloco,
        "diloco",
    ))
