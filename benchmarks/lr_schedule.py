"""Seed claim 2: "warmup for 8% of the steps, then cosine annealing: 15% faster training".

Trains the example model (single process, same seed and data order) with a constant LR and with
``WarmupCosineAnnealingLR`` (warmup 8%, min LR 1% of peak) at the same peak LR, for each peak LR in
``--lrs``. "Faster" is measured as steps to reach the loss the constant-LR run ends with (smoothed over
``WINDOW`` steps): speed-up = steps(constant) / steps(schedule). Also reports the held-out loss of both.
Writes the ``lr_schedule`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/lr_schedule.py [--steps 300] [--lrs 3e-3 1e-2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from examples.data import ByteCorpusDataModule  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402
from lightning_ciuic import WarmupCosineAnnealingLR  # noqa: E402

WINDOW = 20


def train(peak_lr: float, steps: int, schedule: bool) -> tuple[list[float], float]:
    torch.manual_seed(0)
    data = ByteCorpusDataModule(seq_len=64, batch_size=16)
    data.setup()
    module = DeepSeekMini(lr=peak_lr)
    optimizer = module.configure_optimizers()
    scheduler = WarmupCosineAnnealingLR(optimizer, int(steps * 0.08), steps, peak_lr * 0.01) if schedule else None
    torch.manual_seed(1)
    batches = iter(torch.utils.data.DataLoader(data.train_set, batch_size=16, shuffle=True, drop_last=True))
    losses = []
    for _ in range(steps):
        loss = module.pipelined_loss(next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    with torch.no_grad():
        val = [module.pipelined_loss(b).item() for _, b in zip(range(16), data.val_dataloader())]
    return losses, sum(val) / len(val)


def smoothed(losses: list[float]) -> list[float]:
    return [sum(losses[max(0, i - WINDOW + 1) : i + 1]) / len(losses[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(losses))]


def steps_to(target: float, losses: list[float]) -> int | None:
    return next((i + 1 for i, value in enumerate(smoothed(losses)) if value <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    args = parser.parse_args()
    rows = []
    for lr in args.lrs:
        constant, constant_val = train(lr, args.steps, schedule=False)
        cosine, cosine_val = train(lr, args.steps, schedule=True)
        target = smoothed(constant)[-1]
        reached = steps_to(target, cosine)
        speedup = args.steps / reached if reached else None
        rows.append((lr, target, smoothed(cosine)[-1], constant_val, cosine_val, reached, speedup))
        print(rows[-1])
    table = "\n".join(
        f"| {lr:g} | {t:.3f} | {c:.3f} | {cv:.3f} | {sv:.3f} | {reached or 'never'} of {args.steps} | "
        f"**{'n/a' if s is None else f'{(s - 1) * 100:+.0f}%'}** |"
        for lr, t, c, cv, sv, reached, s in rows
    )
    write_section(
        "lr_schedule",
        f"""
## Warmup-cosine schedule vs constant LR (seed claim: "15% faster training")

Command: `.venv/bin/python benchmarks/lr_schedule.py --steps {args.steps} --lrs {' '.join(f'{x:g}' for x in args.lrs)}`
(example model, 1 process, batch 16 x 64 bytes, AdamW, clip 1.0, same seed and data order; warmup 8%,
min LR 1% of peak; machine: {machine()}). "Steps to target" is when the schedule's training loss
(mean of the last {WINDOW} steps) first reaches the constant-LR run's final value; speed-up is
`{args.steps} / steps to target - 1`.

| peak LR | constant: final train loss | schedule: final train loss | constant: val loss | schedule: val loss | schedule steps to target | speed-up |
|---|---|---|---|---|---|---|
{table}
""",
    )


if __name__ == "__main__":
    main()
