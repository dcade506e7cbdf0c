"""CommunicationMonitor: where each training step's time goes, per rank, and what to change.

Contract:

* Per step and rank (from :mod:`lightning_ciuic.telemetry`, plus the data-parallel engine's counters, summed over its
  reduction groups, dense and experts, where the strategy has one; the engine, the expert layout, the pipeline, the
  groups and the device read from :func:`~lightning_ciuic.strategies.context.parallel_context`, never from the
  strategy's attributes): ``step`` (data wait + batch), ``compute`` (forward + backward up to the last gradient),
  ``data_wait``, ``dp_exposed`` (gradient sync left after backward), ``dp_comm`` (first bucket launched to last
  bucket reduced; under ``DDPStrategy`` only the exposed part is visible), ``dp_bytes`` (sent by this rank),
  ``dp_payload`` (gradient bytes reduced), ``tp_comm`` (tensor-parallel collectives, timed on every
  ``profile_every``-th step by intercepting the functional collectives DTensor issues; that step's other
  timings are left out of the means), ``memory_mb`` (peak: CUDA allocator, or the process's RSS on CPU); under
  expert parallelism ``ep_bytes`` (sent in the token all-to-alls; ``ep_inter_bytes`` of them over the inter-node
  link, the ep ranks placed on nodes by ``expert_devices_per_node``), ``ep_comm`` (their wall time, forward and
  backward, from issue to completion, waiting for busier ranks included), ``ep_exposed`` (of it, the time the training
  thread was blocked on them: all of it without ``expert_dispatch_overlap``; the hidden part is ``1 - ep_exposed /
  ep_comm``) and ``ep_tokens`` (rows this rank's experts ran); the blocked waits are spans of the trace's ``ep
  collectives`` track (on the CPU).
* Mixture-of-experts layers (packed experts, with or without expert parallelism): the tokens routed to each expert
  over the run, summed over the data-parallel ranks, as ``expert_load`` (layer -> max / mean) in ``monitor.json``,
  the summary and the report's findings.
* Derived: straggler wait (the slowest rank's compute minus this rank's), the dp sync's effective throughput
  (``payload / dp_comm``, and ``x 2 (n-1) / n`` per link: bytes per second of the sync window, which includes the
  backward it overlaps, so not nccl-tests' algbw / busbw, which divide by the collectives' own time; rates in
  GB/s, :func:`lightning_ciuic.advice.profile.format_rate`), and overlap (``1 - exposed / comm``).
* Output: rank-local metrics ``monitor/<field>_ms`` (and ``monitor/dp_bytes``, ``monitor/memory_mb``) every
  ``log_every_n_steps``; every ``gather_every`` steps the window's per-rank means are gathered and logged as
  ``monitor/rank<r>/compute_ms`` and ``monitor/rank<r>/step_ms``; at the end of training, on rank 0: a summary
  table and the advice in the terminal, ``monitor.json`` (what ``lightning-ciuic advise`` reads) and a
  self-contained ``report.html`` in ``dirpath`` (default ``<trainer.log_dir or default_root_dir>/monitor``).
  ``monitor.json`` carries the callback's ``run_id`` (made at construction, so the copies spawned ranks get share
  it); :meth:`CommunicationMonitor.record_path` finds this run's file again, never another run's newer one.
* Trace (``trace=True``): spans in integer epoch nanoseconds, each boundary one ``time.perf_counter`` reading
  converted once (:func:`lightning_ciuic.timeline.wall_clock_ns`) and shared by the span that ends there and the
  one that starts there; a step's data wait is drawn after a training-thread span that ended inside it (a
  checkpoint staged after the previous step), so no two spans of a track overlap without nesting.
* Advice comes from :func:`lightning_ciuic.advice.advise`; with ``measure_link`` the data-parallel link is
  measured once at the start of training (latency, bandwidth, and each dense compression mode's time to
  synchronize this model's gradient while the machine computes), which is what compression predictions need. It takes a few seconds, before the first step.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import threading
import time
import uuid
from bisect import bisect_right
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_ciuic.advice import RANK_FIELDS, RunProfile, check
from lightning_ciuic.advice.trace import TraceEvent
from lightning_ciuic.compat import TorchDispatchMode
from lightning_ciuic.comm.auto import measure_link, measure_sync_seconds, synchronize
from lightning_ciuic.callbacks.expert_balance import ExpertLoadBalancer
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.experts import ExpertLayout, RoutedTokens, packed_experts
from lightning_ciuic.advice.report import summary_table, write_report
from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.telemetry import StepRecord, Telemetry, gather_per_rank
from lightning_ciuic.timeline import timeline, wall_clock_ns
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.validation import check_int

_WARMUP_STEPS = 2  # first steps (allocation, first collectives) left out of the means
_TIMED = (
    "step", "compute", "data_wait", "dp_exposed", "dp_comm", "tp_comm", "dp_gather", "dp_scatter", "pp_bubble",
    "checkpoint_stall", "snapshot_stall", "outer_sync", "ep_comm", "ep_exposed",
)


class CollectiveTimer(TorchDispatchMode):
    """Times the functional collectives (launch and ``wait_tensor``) issued while active, by mesh axis. On a GPU
    it synchronizes the device around each of them (it runs on sampled steps only), so the times are the
    device's, not the host's queueing."""

    def __init__(self, axis_of_group: dict[str, str], device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self._pending: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func.namespace != "_c10d_functional":
            return func(*args, **(kwargs or {}))
        synchronize(self.device)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        synchronize(self.device)
        end = time.perf_counter()
        if func.__name__.startswith("wait_tensor"):
            axis = self._pending.pop(id(args[0]), None)
        else:
            axis = next((self.axis_of_group[a] for a in args if isinstance(a, str) and a in self.axis_of_group), None)
            if isinstance(out, torch.Tensor):
                self._pending[id(out)] = axis or "other"
            self.count[axis or "other"] += 1
        self.seconds[axis or "other"] += end - start
        timeline.record(func.__name__.split(".")[0], axis or "other", start, end, track=f"{axis or 'other'} collectives")
        return out


class CommunicationMonitor(Callback):
    """Per-rank step-time breakdown, bandwidth, overlap, report and advice; see the module docstring.

    Args:
        dirpath: where ``monitor.json`` and ``report.html`` go (any local path).
        gather_every: optimizer steps between gathers of every rank's window (>= 1).
        profile_every: every this many steps, time tensor-parallel collectives (>= 1).
        measure_link: measure the data-parallel link and each compression mode's sync time at the start of training.
        log_every_n_steps: rank-local metrics every this many steps (default: the Trainer's).
        trace: also write ``trace.json``, a Chrome trace of the last ``trace_steps`` steps (Perfetto,
            ``chrome://tracing``): one process per rank, a track per kind of work.
        trace_steps: how many of the last training steps the trace keeps (>= 1).
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        gather_every: int = 50,
        profile_every: int = 50,
        measure_link: bool = True,
        log_every_n_steps: Optional[int] = None,
        trace: bool = False,
        trace_steps: int = 500,
    ) -> None:
        for name, value in (("gather_every", gather_every), ("profile_every", profile_every), ("trace_steps", trace_steps)):
            check_int(name, value, note="optimizer steps")
        check_int("log_every_n_steps", log_every_n_steps, allowed=(None,), note="None: the Trainer's")
        self.dirpath = dirpath
        self.gather_every, self.profile_every = gather_every, profile_every
        self.measure_link = measure_link
        self.log_every_n_steps = log_every_n_steps
        self.trace, self.trace_steps = trace, trace_steps
        self.run_id = uuid.uuid4().hex  # in monitor.json; made here, so the ranks' pickled copies share it
        self.written: Optional[Path] = None  # the monitor.json this process wrote (rank 0 of an in-process run)
        self._trace_steps: deque[list[TraceEvent]] = deque(maxlen=trace_steps)  # this rank's step events
        self.profile: Optional[RunProfile] = None
        self.windows: list[dict[str, Any]] = []  # rank 0: {"step": int, "ranks": [per-rank means]}
        self._window = _Window()
        self._total = _Window()
        self._cursor = 0
        self._timer: Optional[CollectiveTimer] = None  # set for a profiled step, active from batch start to the optimizer step
        self._timer_active = False
        self._sync_seen: tuple[float, ...] = (0.0,) * 5
        self._last_gather = 0
        self._meta: dict[str, Any] = {}
        self._bubbles: list[float] = []  # this rank's measured pipeline bubble per step, after warm-up
        self._experts: Optional[ExpertLayout] = None  # expert parallelism's layout, whose stats count the all-to-alls
        self._expert_seen: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._routed: Optional[RoutedTokens] = None  # tokens per expert, for expert_load

    # -- set-up --------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.windows, self._window, self._total, self._bubbles = [], _Window(), _Window(), []
        self.written = None
        self._trace_steps.clear()
        self._cursor = Telemetry.of(trainer).records_since(0)[1]
        context = self._context = parallel_context(trainer)
        dims, engine = context.dims, context.data_parallel
        self._axis_of_group = context.axis_of_group()
        if engine is not None:
            numel, buckets = engine.payload()
            compression = engine.label
        else:  # DDP and others: torch's bucketing (25 MB)
            numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            buckets, compression = max(1, math.ceil(numel * 4 / (25 * 2**20))), "none"
        self._meta = dict(
            world_size=trainer.world_size,
            dp=dims.dp,
            tp=dims.tp,
            pp=dims.pp,
            compression=compression,
            gradient_numel=int(numel),
            buckets=buckets,
            dp_rank_of=[],
            latency_s=None,
            bandwidth_bytes_per_s=None,
            codec_s_per_value={},
            sync_s={},
            num_microbatches=context.pipeline.num_microbatches if context.pipeline is not None else None,
            dp_shard=dims.dp_shard,
            memory_capacity_mb=_memory_capacity_mb(context.device, trainer),
        )
        if self.measure_link and context.dp_group is not None:
            latency, bandwidth = measure_link(context.dp_group, device=context.device)
            self._meta.update(latency_s=latency, bandwidth_bytes_per_s=bandwidth)
            self._meta["sync_s"] = measure_sync_seconds(
                context.dp_group, self._meta["gradient_numel"], self._meta["buckets"], device=context.device
            )
        self._sync_seen = self._sync_counters()
        self._dp_rank = context.dp_rank
        self._pp_rank = context.mesh.get_local_rank(Axis.PP) if dims.pp > 1 and context.mesh is not None else 0
        self._experts = context.experts
        self._expert_seen = self._expert_counters()
        self._routed = RoutedTokens(pl_module) if packed_experts(pl_module) else None
        balancer = next((c for c in trainer.callbacks if isinstance(c, ExpertLoadBalancer)), None)
        self._meta.update(ep=dims.ep, expert_balancer_rate=balancer.bias_update_rate if balancer is not None else None)

    def _expert_counters(self) -> tuple[float, float, float, float, float]:
        """Bytes sent in the token all-to-alls, rows this rank's experts ran, the all-to-alls' seconds, of the bytes
        those that crossed the inter-node link, and of the seconds those the training thread was blocked (totals)."""
        if self._experts is None:
            return 0.0, 0.0, 0.0, 0.0, 0.0
        stats = self._experts.stats
        self._experts.clock.collect()
        inter = sum(by_link["inter"] for by_link in stats.link_bytes.values())
        return (
            float(stats.dispatch_bytes + stats.combine_bytes), float(stats.received_tokens), stats.seconds, float(inter),
            stats.exposed_seconds,
        )

    def _sync_counters(self) -> tuple[float, ...]:
        engine = self._context.data_parallel
        if engine is None:
            return (0.0,) * 5
        stats = engine.stats
        return (stats.comm_seconds, float(stats.bytes_sent), float(stats.bytes_reduced), stats.gather_seconds, stats.scatter_seconds)

    # -- per step ------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        Telemetry.of(trainer).begin(trainer.global_step, batch_idx, batch)
        if set(self._axis_of_group.values()) - {"dp"} and trainer.global_step % self.profile_every == 0 and self._timer is None:
            self._timer = CollectiveTimer(self._axis_of_group, self._context.device)
            self._timer.__enter__()
            self._timer_active = True

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        Telemetry.of(trainer).before_optimizer_step()
        self._stop_timer()

    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer_active:
            self._timer.__exit__(None, None, None)
            self._timer_active = False

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        telemetry = Telemetry.of(trainer)
        telemetry.end()
        self._stop_timer()
        timer, self._timer = self._timer, None
        records, self._cursor = telemetry.records_since(self._cursor)
        counters, last = self._sync_counters(), self._sync_seen
        self._sync_seen = counters
        experts, experts_last = self._expert_counters(), self._expert_seen
        self._expert_seen = experts
        if not records:
            return
        record = records[-1]
        if self._context.data_parallel is not None:
            comm, sent, payload, gather, scatter = (now - before for now, before in zip(counters, last))
        else:  # DDP and others: only the exposed wait is visible; bytes from the ring all-reduce formula
            synced = record.optimizer_step and self._meta["dp"] > 1
            comm, sent, payload = record.sync_wait, self._ddp_bytes() if synced else 0.0, 4.0 * self._meta["gradient_numel"] * synced
            gather = scatter = 0.0
        bubble = self._context.pipeline.bubble * record.compute if self._context.pipeline is not None else 0.0
        values = {
            "step": record.data_wait + record.duration,
            "compute": record.compute,
            "data_wait": record.data_wait,
            "dp_exposed": record.sync_wait,
            "dp_comm": comm,
            "dp_bytes": float(sent),
            "dp_payload": float(payload),
            "memory_mb": _peak_memory_mb(self._context.device),
            "dp_gather": gather,
            "dp_scatter": scatter,
            "pp_bubble": bubble,
            "checkpoint_stall": record.stalls.get("checkpoint", 0.0),
            "snapshot_stall": record.stalls.get("snapshot", 0.0),
            "outer_sync": record.stalls.get("outer_sync", 0.0),
            "ep_bytes": experts[0] - experts_last[0],
            "ep_tokens": experts[1] - experts_last[1],
            "ep_comm": experts[2] - experts_last[2],
            "ep_inter_bytes": experts[3] - experts_last[3],
            "ep_exposed": experts[4] - experts_last[4],
        }
        if self.trace:
            self._trace_steps.append(step_events(record, comm))
        if timer is not None:  # a profiled step: only its collective time is kept
            tp_seconds = sum(s for axis, s in timer.seconds.items() if axis != "dp")
            self._window.add_profiled(tp_seconds)
            self._total.add_profiled(tp_seconds)
        elif record.step >= _WARMUP_STEPS:
            self._window.add(values)
            self._total.add(values)
            if self._context.pipeline is not None:
                self._bubbles.append(self._context.pipeline.bubble)
        step = trainer.global_step
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if step % every == 0 and self._window.last:
            for key, value in self._window.last.items():
                name = f"monitor/{key}_ms" if key in _TIMED else f"monitor/{key}"
                pl_module.log(name, value * 1e3 if key in _TIMED else value, on_step=True, on_epoch=False)
        if step % self.gather_every == 0 and step not in (0, self._last_gather):
            self._last_gather = step
            self._gather(trainer, pl_module, step, log=True)

    def _ddp_bytes(self) -> float:
        dp = self._meta["dp"]
        return 2 * (dp - 1) / dp * self._meta["gradient_numel"] * 4.0 if dp > 1 else 0.0

    def _gather(self, trainer: Trainer, pl_module: Optional[LightningModule], step: int, log: bool) -> None:
        rows = gather_per_rank(trainer, [float(self._dp_rank), float(self._pp_rank), *self._window.means()])
        self._window = _Window()
        ranks = [dict(zip(RANK_FIELDS, row[2:].tolist())) for row in rows]
        self._meta["dp_rank_of"] = [int(row[0]) for row in rows]
        self._meta["pp_rank_of"] = [int(row[1]) for row in rows]
        if trainer.is_global_zero:
            self.windows.append({"step": step, "ranks": ranks})
        if log and pl_module is not None:
            for rank, values in enumerate(ranks):
                pl_module.log(f"monitor/rank{rank}/compute_ms", values["compute"] * 1e3, on_step=True, on_epoch=False, rank_zero_only=True)
                pl_module.log(f"monitor/rank{rank}/step_ms", values["step"] * 1e3, on_step=True, on_epoch=False, rank_zero_only=True)

    # -- the end -------------------------------------------------------------------------------------
    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_timer()
        if self._window.count:
            self._gather(trainer, None, trainer.global_step, log=False)
        totals = gather_per_rank(trainer, self._total.means())
        if self._meta["num_microbatches"] is not None:  # pipeline parallel: the bubble, averaged over ranks
            local = statistics.fmean(self._bubbles) if self._bubbles else 0.0
            self._meta["bubble"] = float(gather_per_rank(trainer, [local]).mean())
        self._meta["model_state_mb"] = _held_state_mb(pl_module, trainer.optimizers)
        self._meta["expert_load"] = self._expert_load()  # collective
        self.profile = RunProfile(**self._meta, ranks=[dict(zip(RANK_FIELDS, row.tolist())) for row in totals])
        out = Path(self.dirpath or os.path.join(trainer.log_dir or trainer.default_root_dir, "monitor"))  # collective
        trace = _gather_objects(self._trace_events()) if self.trace else None  # collective
        if not trainer.is_global_zero:
            return
        record = {"run_id": self.run_id, "profile": self.profile.to_json(), "windows": self.windows, **({"trace": trace} if trace else {})}
        out.mkdir(parents=True, exist_ok=True)
        (out / "monitor.json").write_text(json.dumps(record, indent=1))
        self.written = Path(os.path.abspath(out / "monitor.json"))
        written = write_report(out, record)
        findings = check(self.profile)
        advice = [f.advice for f in findings if f.advice is not None]
        lines = [summary_table(self.profile), "", "Advice:" if advice else f"Advice: none ({len(findings)} rules checked, nothing predicted to gain >= 10%)."]
        lines += [f"  - {item}" for item in advice]
        rank_zero_info("\n".join(lines) + "\n" + ", ".join(f"{kind}: {path}" for kind, path in written.items()))

    def _expert_load(self) -> dict[str, float]:
        """Max / mean tokens per expert of each layer over the run, all data-parallel ranks' tokens (collective)."""
        local: dict[str, float] = {}
        if self._routed is not None:
            for layer, counts in sorted(self._routed.take().items()):
                counts = counts.double()
                if self._context.dp_group is not None:
                    torch.distributed.all_reduce(counts, group=self._context.dp_group)
                local[layer] = float(counts.max() / counts.mean()) if counts.sum() > 0 else 0.0
        merged: dict[str, float] = {}
        for part in _gather_objects(local):  # pipeline stages hold different layers
            merged.update(part)
        return merged

    def record_path(self, trainer: Trainer) -> Optional[Path]:
        """This run's ``monitor.json``: the file this process wrote, or, in a launching process whose ranks ran
        elsewhere (spawned ranks write with their own copies of this callback), the newest ``monitor.json`` under
        ``dirpath`` (default: the Trainer's ``default_root_dir`` and its loggers' folders) that carries this
        callback's ``run_id``. ``None`` when there is none: another run's file is never taken for this one's."""
        if self.written is not None:
            return self.written if self.written.is_file() else None
        if self.dirpath:
            roots = [Path(self.dirpath)]
        else:
            loggers = getattr(trainer, "loggers", None) or []
            roots = [Path(trainer.default_root_dir), *(Path(r) for r in (getattr(l, "root_dir", None) for l in loggers) if r)]
        roots = [Path(os.path.abspath(root)) for root in roots]  # one name per file, found from either root
        found = {path for root in roots if root.is_dir() for path in root.rglob("monitor.json")}
        for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
            try:
                if json.loads(path.read_text()).get("run_id") == self.run_id:
                    return path
            except (OSError, ValueError, AttributeError):  # unreadable, half-written, not a record
                continue
        return None

    def _trace_events(self) -> list[TraceEvent]:
        """This rank's step events, and the timeline's spans since the first step kept. A step's data wait starts
        at the end of the last training-thread span that ended inside it, if any (a checkpoint staged after the
        previous step, in the gap the data wait is measured from, less that staging). A span still running on
        another thread (a checkpoint write in flight as training ends) ends now, named ``... (running at train
        end)``."""
        steps = [event for step in self._trace_steps for event in step]
        if not steps:
            return steps
        since = min(e[3] for e in steps)
        training = threading.current_thread().name
        now, ended, running = timeline.now_since((since - wall_clock_ns(0.0)) / 1e9)
        spans: list[TraceEvent] = []
        for span in ended:
            track = "training" if span.track == training else span.track
            spans.append((track, span.name, span.category, wall_clock_ns(span.start), wall_clock_ns(span.end)))
        for span in running:
            if span.track != training:
                spans.append((span.track, f"{span.name} (running at train end)", span.category, wall_clock_ns(span.start), wall_clock_ns(now)))
        ends = sorted(e[4] for e in spans if e[0] == "training")
        events: list[TraceEvent] = []
        for event in steps:
            if event[:2] == ("training", "data wait"):
                i = bisect_right(ends, event[4])
                if i and ends[i - 1] > event[3]:
                    event = (*event[:3], ends[i - 1], event[4])
                    if event[3] >= event[4]:
                        continue
            events.append(event)
        return events + spans

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._routed is not None:
            self._routed.remove()
            self._routed = None
        self._stop_timer()
        Telemetry.release(trainer)


def step_events(record: StepRecord, dp_comm: float) -> list[TraceEvent]:
    """A step's spans on the training track, and its data-parallel synchronization window on the ``dp collectives``
    track: first bucket launched to last reduced, placed to end where the step stopped waiting for it. Each
    boundary is one ``time.perf_counter`` time converted once to epoch nanoseconds, the end of one span and the
    start of the next."""
    start = record.start
    grads = start + record.compute
    synced = grads + record.sync_wait
    at = wall_clock_ns
    events: list[TraceEvent] = [
        ("training", "data wait", "data", at(start - record.data_wait), at(start)),
        ("training", f"step {record.step}: forward + backward", "compute", at(start), at(grads)),
        ("training", "dp sync (exposed)", "dp", at(grads), at(synced)),
        ("training", "optimizer step + callbacks", "optimizer", at(synced), at(start + record.duration)),
    ]
    if dp_comm > 0:
        events.append(("dp collectives", "gradient synchronization", "dp", at(synced - dp_comm), at(synced)))
    return [e for e in events if e[4] > e[3]]


def _gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a list indexed by global rank); collective when a process group is up."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _Window:
    """Running sums of the per-step fields (means on demand); profiled steps count only for ``tp_comm``."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.count = 0
        self.profiled, self.profiled_seconds = 0, 0.0
        self.last: dict[str, float] = {}
        self.peak_memory = 0.0

    def add(self, values: dict[str, float]) -> None:
        self.count += 1
        self.last = values
        self.peak_memory = max(self.peak_memory, values["memory_mb"])
        for key, value in values.items():
            self.sums[key] += value

    def add_profiled(self, seconds: float) -> None:
        self.profiled += 1
        self.profiled_seconds += seconds

    def means(self) -> list[float]:
        out = []
        for key in RANK_FIELDS:
            if key == "tp_comm":
                out.append(self.profiled_seconds / self.profiled if self.profiled else 0.0)
            elif key == "memory_mb":
                out.append(self.peak_memory)
            else:
                out.append(self.sums[key] / self.count if self.count else 0.0)
        return out


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _memory_capacity_mb(device: torch.device, trainer: Trainer) -> Optional[float]:
    """What one rank may use: its GPU's memory, or the host's RAM shared by this node's processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return ram / 2**20 / max(1, trainer.num_devices)


def _held_state_mb(module: LightningModule, optimizers: list[Any]) -> float:
    """Megabytes of parameters, gradients and optimizer state this rank holds (local shards of DTensors)."""
    tensors = [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None)]
    tensors += [t for o in optimizers for state in o.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors) / 2**20
