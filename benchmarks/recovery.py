"""SnapshotRecovery against Lightning's standard recovery (checkpoint + ``fit(ckpt_path="last")``), side by side.

Every run is a real ``torchrun --nproc-per-node=2 --max-restarts=1`` job (c10d rendezvous) training the DeepSeek-style
example model (``--model``, AdamW) with ``HybridParallelStrategy`` (dp=2) on the shipped corpus.

* Restart: rank 1 is killed with SIGKILL in step ``--fault-step``; state is saved every ``--every`` steps by
  ``SnapshotRecovery(store="shm")`` (raw, and zstd) or by Lightning's ``ModelCheckpoint(save_last=True)``, whose restart runs
  ``fit(ckpt_path="last")`` (the same script, as a user would write it). Measured from the fault (the timestamp
  the injector prints) to the end of the first training step of the restarted run, with its parts: restart and
  imports, set-up up to ``on_fit_start``, the restore itself, the first step; and to the end of the step that
  failed (the lost steps recomputed).
* In-process: a NaN gradient in step ``--fault-step`` and ``SnapshotRecovery`` rolls back without a restart; the
  same kind of fault handled the standard way is a restart from the last checkpoint (the figure above).
* Snapshot cost: ``--cost-steps`` steps with no recovery, with the per-step health check only (with and without
  ``check_gradients``), and with a snapshot every ``--every`` steps; the cost at the default ``snapshot_freq=500``
  is the health check plus the measured time per snapshot spread over 500 steps.

Writes the ``recovery`` section of docs/benchmarks.md; ``--costs-only`` measures only the health checks' cost and
writes the ``recovery_check_cost`` section.

    .venv/bin/python benchmarks/recovery.py [--model xl] [--every 10] [--fault-step 15] [--steps 20] [--rounds 2] [--costs-only]
"""

from __future__ import annotations

import time

_STARTED = time.time()  # before the heavy imports: a restarted worker's first moment

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_IMPORTS_START = time.time()

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from benchmarks.common import MODELS, describe, free_port, machine, write_section  # noqa: E402
from examples.data import ByteCorpusDataModule  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402
from lightning_ciuic import HybridParallelStrategy  # noqa: E402
from lightning_ciuic.callbacks.recovery import SnapshotRecovery, _finite  # noqa: E402  (_finite: check_gradients' pass)
from lightning_ciuic.testing import FailAt  # noqa: E402

_IMPORTED = time.time()
CORPUS = ROOT / "examples" / "data" / "kjv_pentateuch.txt"
MODELS = dict(
    MODELS,
    xl=dict(dim=768, moe_inter_dim=768, dense_inter_dim=2304, kv_lora_rank=192),
    xxl=dict(dim=1280, moe_inter_dim=1280, dense_inter_dim=3840, kv_lora_rank=320),  # 91.8M parameters: 1.1 GB with AdamW
)
S3_OPTIONS = "CIUIC_BENCH_S3_OPTIONS"  # checkpoint_s3 runs: the fsspec storage options of the S3 endpoint, as JSON


class Moments(Callback):
    """Rank 0 prints wall-clock moments of this process: set-up, fit start, train start, every step end."""

    def __init__(self) -> None:
        self.snapshots: SnapshotRecovery | None = None
        self.step_ends: list[tuple[int, float]] = []
        self.step_starts: list[tuple[int, float]] = []  # (global_step before the batch, wall time)
        self.periods: list[float] = []  # batch start to next batch start: every callback's work included
        self._start: float | None = None

    def on_fit_start(self, trainer, pl_module):
        self.fit_start = time.time()

    def on_train_start(self, trainer, pl_module):
        self.train_start = time.time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step_starts.append((trainer.global_step, time.time()))
        now = time.perf_counter()
        if self._start is not None:
            self.periods.append(now - self._start)
        self._start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_ends.append((trainer.global_step, time.time()))

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        record = {
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "started": _STARTED, "imports_start": _IMPORTS_START, "imported": _IMPORTED,
            "fit_start": self.fit_start, "train_start": self.train_start, "step_ends": self.step_ends, "step_starts": self.step_starts, "periods": self.periods,
            "snapshot_seconds": self.snapshots.snapshot_seconds if self.snapshots else 0.0,
            "rollback_seconds": [e.seconds for e in self.snapshots.events] if self.snapshots else [],
        }
        print("MOMENTS " + json.dumps(record), flush=True)


def job(args: argparse.Namespace) -> None:
    """One rank of a run (started by torchrun)."""
    torch.set_num_threads(1)
    seed_everything(0)
    moments = Moments()
    callbacks: list[Callback] = [moments]
    ckpt_path = None
    if args.method in ("snapshot", "snapshot_zstd"):
        compression = "zstd" if args.method == "snapshot_zstd" else "none"
        moments.snapshots = SnapshotRecovery(snapshot_freq=args.every, store="shm", run_id=args.run_id, state_compression=compression)
        callbacks.append(moments.snapshots)  # after Moments: its on_fit_start moment precedes the restore
    elif args.method == "snapshot_checked":  # the gradient check catches a NaN gradient in its own step
        moments.snapshots = SnapshotRecovery(snapshot_freq=args.every, store="shm", run_id=args.run_id, check_gradients=True)
        callbacks.append(moments.snapshots)
    elif args.method in ("health", "health_checked"):
        check = args.method == "health_checked"
        moments.snapshots = SnapshotRecovery(snapshot_freq=10**9, store="memory", check_gradients=check)
        callbacks.append(moments.snapshots)
    elif args.method == "checkpoint":
        callbacks.append(ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_top_k=0, save_last=True))
        ckpt_path = "last"
    elif args.method == "checkpoint_s3":  # benchmarks/recovery_s3.py: the pack's checkpoints in an object store
        from lightning_ciuic import AsyncCheckpointer

        options = json.loads(os.environ[S3_OPTIONS])
        callbacks.append(AsyncCheckpointer(args.dir, save_interval=None, every_n_train_steps=args.every, storage_options=options,
                                           save_on_train_end=False))
        ckpt_path = "last"
    if args.fault != "none":
        callbacks.append(FailAt(args.fault_step, args.fault, ranks=(1,)))
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(), max_steps=args.steps, callbacks=callbacks,
        logger=False, enable_checkpointing=args.method.startswith("checkpoint"), enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    data = ByteCorpusDataModule(CORPUS, seq_len=128, batch_size=4)
    trainer.fit(DeepSeekMini(**MODELS[args.model]), data, ckpt_path=ckpt_path)


def run(
    args: argparse.Namespace, method: str, fault: str, steps: int, directory: str, prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[list[dict], float | None]:
    """Launch a job (after ``prefix``, e.g. ``ip netns exec NS``, with ``env`` added); return rank 0's moment
    records (one per attempt that finished) and the fault time."""
    command = [
        *prefix, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", __file__, "--job",
        "--method", method, "--fault", fault, "--steps", str(steps), "--every", str(args.every),
        "--fault-step", str(args.fault_step), "--model", args.model, "--dir", directory,
        "--run-id", f"bench-{os.getpid()}-{time.time_ns()}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), timeout=1800)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{method}/{fault} run failed:\n{output[-4000:]}")
    records = [json.loads(line.split("MOMENTS ", 1)[1]) for line in output.splitlines() if "MOMENTS " in line]
    fault_at = re.search(r"FailAt: rank 1, step \d+: \w+ at ([0-9.]+)", output)
    return records, float(fault_at.group(1)) if fault_at else None


def restart_timeline(records: list[dict], fault_at: float, fault_step: int) -> dict[str, float]:
    (restarted,) = [r for r in records if r["attempt"] == 1]
    first_step_end = restarted["step_ends"][0][1]
    caught_up = next(t for step, t in restarted["step_ends"] if step >= fault_step)
    return {
        "restart": restarted["started"] - fault_at,  # failure detected, workers stopped and started again
        "imports": restarted["imported"] - restarted["started"],
        "setup": restarted["fit_start"] - restarted["imported"],  # process group, model, strategy set-up
        "restore": restarted["train_start"] - restarted["fit_start"],  # the restore (and the data set-up)
        "first_step": first_step_end - restarted["train_start"],
        "to_training": restarted["step_starts"][0][1] - fault_at,
        "to_first_step": first_step_end - fault_at,
        "to_caught_up": caught_up - fault_at,
        # measured: steps of the failed attempt that the restored state no longer holds
        "steps_lost": fault_step - 1 - restarted["step_starts"][0][0],
    }


def part_labels(fault_step: int) -> dict[str, str]:
    """The parts of :func:`restart_timeline`, as the tables name them."""
    return {
        "restart": "fault -> restarted process starts (detection, stop, spawn)",
        "imports": "Python imports (torch, Lightning, ...)",
        "setup": "set-up up to on_fit_start (process group, model, strategy)",
        "restore": "restore (on_fit_start -> on_train_start: the state and the data position)",
        "first_step": "the first training step",
        "to_training": "**fault -> training again (the first new step starts)**",
        "to_first_step": "fault -> end of the first training step after recovery",
        "to_caught_up": f"fault -> end of step {fault_step} again (lost steps recomputed)",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", action="store_true")
    parser.add_argument("--method", default="snapshot")
    parser.add_argument("--fault", default="none")
    parser.add_argument("--model", default="xl", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cost-steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--costs-only", action="store_true", help="only the per-step health checks' cost")
    args = parser.parse_args()
    if args.job:
        job(args)
        return
    if args.costs_only:
        check_costs(args)
        return

    timelines: dict[str, list[dict[str, float]]] = {"snapshot": [], "snapshot_zstd": [], "checkpoint": []}
    rollbacks: dict[str, list[dict[str, float]]] = {"snapshot": [], "snapshot_checked": []}
    costs: dict[str, list[float]] = {"none": [], "health": [], "snapshot": []}
    snapshot_seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for method in timelines:  # interleaved: the machine's drift hits all alike
                records, fault_at = run(args, method, "kill", args.steps, f"{tmp}/{method}-{round_}")
                timelines[method].append(restart_timeline(records, fault_at, args.fault_step))
            for method in rollbacks:
                records, fault_at = run(args, method, "nan", args.steps, f"{tmp}/nan-{method}-{round_}")
                (record,) = records
                # Rolled back to the snapshot's step: the first step after it is the first new one.
                snapshot_step = (args.fault_step - 1) // args.every * args.every
                after = next(t for step, t in record["step_ends"] if t > fault_at and step == snapshot_step + 1)
                resumed = next(t for step, t in record["step_starts"] if t > fault_at and step == snapshot_step)
                restored_step = min(step for step, t in record["step_starts"] if t > fault_at)  # the step rolled back to
                rollbacks[method].append(
                    {"restore": record["rollback_seconds"][0], "to_next_step": after - fault_at, "to_training": resumed - fault_at,
                     "steps_lost": args.fault_step - 1 - restored_step}  # as restart_timeline counts them
                )
            for method in costs:
                (record,) = run(args, method, "none", args.cost_steps, f"{tmp}/cost-{method}-{round_}")[0]
                costs[method].append(statistics.median(record["periods"][2:]))
                if method == "snapshot":
                    snapshot_seconds.append(record["snapshot_seconds"] / (args.cost_steps // args.every))

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return statistics.fmean(row[key] for row in rows)

    snap, zstd, ckpt = timelines["snapshot"], timelines["snapshot_zstd"], timelines["checkpoint"]
    ratio = mean(snap, "to_first_step") / mean(ckpt, "to_first_step")
    ratio_zstd = mean(zstd, "to_first_step") / mean(ckpt, "to_first_step")
    ratio_caught_up = mean(snap, "to_caught_up") / mean(ckpt, "to_caught_up")
    restore_ratio = mean(snap, "restore") / mean(ckpt, "restore")
    restore_ratio_zstd = mean(zstd, "restore") / mean(ckpt, "restore")
    in_process = {m: statistics.fmean(r["to_next_step"] for r in rows) for m, rows in rollbacks.items()}
    in_process_start = {m: statistics.fmean(r["to_training"] for r in rows) for m, rows in rollbacks.items()}
    restart_start = mean(ckpt, "to_training")
    ratio_start = mean(snap, "to_training") / restart_start
    in_process_restore = {m: statistics.fmean(r["restore"] for r in rows) for m, rows in rollbacks.items()}
    step_none = statistics.fmean(costs["none"])
    health = statistics.fmean(costs["health"]) / step_none - 1
    health_rounds = ", ".join(f"{h / n - 1:+.1%}" for h, n in zip(costs["health"], costs["none"]))
    per_snapshot = statistics.fmean(snapshot_seconds)
    snapshot_rounds = ", ".join(f"{x:.2f} s" for x in snapshot_seconds)
    cost_500 = health + per_snapshot / (500 * step_none)
    cost_every = statistics.fmean(costs["snapshot"]) / step_none - 1
    every_rounds = ", ".join(f"{c / n - 1:+.1%}" for c, n in zip(costs["snapshot"], costs["none"]))
    lost_restart = {m: sorted({row["steps_lost"] for row in rows}) for m, rows in timelines.items()}
    lost_rollback = {m: sorted({row["steps_lost"] for row in rows}) for m, rows in rollbacks.items()}
    model = describe(DeepSeekMini(**MODELS[args.model]), args.model)
    rows = [f"| {label} | {mean(snap, p):.2f} s | {mean(zstd, p):.2f} s | {mean(ckpt, p):.2f} s |"
            for p, label in part_labels(args.fault_step).items()]
    write_section(
        "recovery",
        f"""
## SnapshotRecovery vs checkpoint + `ckpt_path="last"` (recovery time, snapshot cost)

Command: `.venv/bin/python benchmarks/recovery.py --model {args.model} --every {args.every} --fault-step {args.fault_step}
--steps {args.steps} --cost-steps {args.cost_steps} --rounds {args.rounds}` (`torchrun --nproc-per-node=2 --max-restarts=1`,
c10d rendezvous, HybridParallelStrategy dp=2, {model} + AdamW, state saved every {args.every} steps by both; means of
{args.rounds} rounds, interleaved; machine: {machine()}).

Restart after `kill -9` of rank 1 in step {args.fault_step}:

| part | SnapshotRecovery (shared memory; default `state_compression="none"`) | SnapshotRecovery (`state_compression="zstd"`) | ModelCheckpoint + `fit(ckpt_path="last")` |
|---|---|---|---|
{chr(10).join(rows)}

| measure | result |
|---|---|
| restart recovery, fault -> training again: snapshot / checkpoint | **{ratio_start:.0%}** (to the end of the first step: {ratio:.0%}, {ratio_zstd:.0%} with zstd) (target <= 20%; seed: an 80% cut) |
| the restore alone: snapshot / checkpoint | {restore_ratio:.0%} ({restore_ratio_zstd:.0%} with zstd) |
| the same, up to the failed step again | {ratio_caught_up:.0%} |
| in-process rollback after a NaN gradient, `check_gradients=True` (caught in its own step), fault -> training again, no restart | {in_process_start['snapshot_checked']:.2f} s; the restore itself {in_process_restore['snapshot_checked']:.2f} s; to the end of the first new step {in_process['snapshot_checked']:.2f} s. Not a like-for-like ratio: with `ModelCheckpoint` the same fault is a restart ({restart_start:.2f} s to training again), which the rollback avoids |
| the same with the default `check_gradients=False` (caught by the next step's NaN loss: one more step is spent) | {in_process_start['snapshot']:.2f} s; to the end of the first new step {in_process['snapshot']:.2f} s |
| steps lost, measured (steps of the failed attempt the restored state does not hold; the values seen over rounds) | restart from a snapshot {lost_restart['snapshot']} (zstd {lost_restart['snapshot_zstd']}), from the checkpoint {lost_restart['checkpoint']}; in-process rollback {lost_rollback['snapshot_checked']} with `check_gradients=True`, {lost_rollback['snapshot']} by default (both save every {args.every} steps) |
| snapshot cost: per-step health check (loss finite, spike rule; one all-reduce of four numbers), whole-step difference | {health:+.1%} of step time (rounds: {health_rounds}) |
| snapshot cost: one snapshot, timed directly ({args.every}-step interval, median step {step_none:.2f} s) | {per_snapshot:.2f} s (rounds: {snapshot_rounds}); with a snapshot every {args.every} steps, step time {cost_every:+.1%} (rounds: {every_rounds}) |
| **snapshot cost at the default `snapshot_freq=500`** (health check + snapshot time / 500 steps) | **{cost_500:+.1%}** of throughput (target <= 3%); the health check's whole-step figure moves by its spread above, the snapshot's share is {per_snapshot / (500 * step_none):.2%} |

- A restart costs the same whichever state it restores (detecting the failure, starting Python, importing torch
  and Lightning, forming the process group, building the model), and that dominates on one machine whose page
  cache holds the checkpoint as surely as /dev/shm holds the snapshot. zstd saves about 8% of fp32 state at about
  0.7 GB/s on one core and costs more in the restore than it saves in memory, so the default is
  `state_compression="none"` (the seed's `"zstd"` is one argument away). Like for like, the seed's 80% cut does
  not hold here: restart against restart the snapshot saves {1 - ratio_start:.0%}, and the restore against the restore
  {1 - restore_ratio:.0%}. What a snapshot buys beyond that is handling a NaN or a loss spike without any restart
  (the in-process rows), which `ModelCheckpoint` cannot. A restart from a checkpoint on slower storage than memory
  (a remote bucket) would widen the gap; this benchmark does not simulate one.
""",
    )


def check_costs(args: argparse.Namespace) -> None:
    """Step time without recovery, with the per-step health check, and with it plus the gradient check."""
    costs: dict[str, list[float]] = {"none": [], "health": [], "health_checked": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for method in costs:  # interleaved: the machine's drift hits all alike
                (record,) = run(args, method, "none", args.cost_steps, f"{tmp}/cost-{method}-{round_}")[0]
                costs[method].append(statistics.median(record["periods"][2:]))
    base = statistics.fmean(costs["none"])
    health, checked = (statistics.fmean(costs[m]) / base - 1 for m in ("health", "health_checked"))
    # The gradient check alone, timed directly (below the noise of whole steps): the model's gradients, one thread.
    torch.set_num_threads(1)
    grads = [torch.randn_like(p) for p in DeepSeekMini(**MODELS[args.model]).parameters()]
    _finite(grads)
    start = time.perf_counter()
    for _ in range(20):
        _finite(grads)
    check_s = (time.perf_counter() - start) / 20
    per_round = ", ".join(f"{c / n - 1:+.1%}" for c, n in zip(costs["health_checked"], costs["none"]))
    print(f"health {health:+.2%}, health + gradients {checked:+.2%} (per round {per_round}); check {check_s * 1e3:.1f} ms, step {base:.2f} s")
    model = describe(DeepSeekMini(**MODELS[args.model]), args.model)
    write_section(
        "recovery_check_cost",
        f"""
## SnapshotRecovery's per-step checks: what `check_gradients` costs

Command: `.venv/bin/python benchmarks/recovery.py --costs-only --model {args.model} --cost-steps {args.cost_steps}
--rounds {args.rounds}` (`torchrun --nproc-per-node=2`, HybridParallelStrategy dp=2, {model} + AdamW, no snapshot
taken; median step time (batch start to batch start) of each run, mean of {args.rounds} interleaved rounds; machine:
{machine()}).

| per-step check | step time vs none |
|---|---|
| loss finite and no spike (one all-reduce of four numbers) | {health:+.1%} |
| the same plus every rank's gradient norm finite (`check_gradients=True`: one more pass over the gradients) | {checked:+.1%} (per round: {per_round}) |
| the gradient pass alone, timed directly on the model's gradients (one thread) | {check_s * 1e3:.1f} ms = **{check_s / base:.2%}** of the median step ({base:.2f} s) |

Whole-step differences between separate runs move by several percent from one invocation to the next on this
machine; the direct timing is the figure to read.
""",
    )


if __name__ == "__main__":
    main()
