"""Sequence and loss parallelism at tp=2: activations per rank, and step time, with and without (issue 47's target).

A Hugging Face Llama (a config written out: nothing is downloaded; ``--vocab`` tokens, so that its logits weigh as an
LLM's do) under ``HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` on 4 CPU processes (gloo),
``sequence_parallel=False`` (the replicated residual stream and whole-vocabulary logits of before) against ``True`` (the
default: norms and residuals hold half the sequence, the logits stay vocabulary-sharded and the loss is computed from
the shards).

1. Memory (not time-sensitive): the activations of one training step per rank (the step's peak less the model states
   held after it, ``planner.train_step.StepMemory.activations``), two ways:
   * the plan's: ``plan_layout(..., step=StepSpec(micro_batch, sequence))`` on torch's fake process group;
   * a real run's: the same ``parallelize()``, engine and steps on 4 real gloo processes, tracked by torch's
     ``MemTracker`` (``planner.train_step.train_steps``, what ``tests/integration/test_plan.py`` holds the plan to).
   Target: sequence-parallel <= 0.6x of replicated, by both figures (the largest rank's).
2. Step time (time-sensitive: run it on a quiet machine): ``Trainer.fit`` of ``--steps`` steps with each setting,
   alternating for ``--rounds`` rounds, 1 intra-op thread per process; a round's ratio is the median step time after
   ``WARMUP`` steps with sequence parallelism over the one without, paired within the round; the median of the rounds'
   ratios and each round's are reported. Target: <= 1.1.

Writes the ``sequence_parallel_memory`` and ``sequence_parallel_time`` sections of docs/benchmarks.md (the parts run;
each part its own section).

    .venv/bin/python benchmarks/sequence_parallel.py [--parts memory time] [--steps 30] [--rounds 3] \
        [--micro-batch-size 4] [--sequence-length 256] [--hidden 512] [--layers 4] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the same intra-op threads for both settings

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks.common import StepTimer, describe, free_port, machine, median_after_warmup, write_section  # noqa: E402
from lightning_ciuic import HybridParallelStrategy  # noqa: E402
from lightning_ciuic.comm.engines import build_engine  # noqa: E402
from lightning_ciuic.config import ParallelismConfig  # noqa: E402
from lightning_ciuic.huggingface import HuggingFaceCausalLM  # noqa: E402
from lightning_ciuic.parallel.parallelize import parallelize  # noqa: E402
from lightning_ciuic.planner import plan_layout  # noqa: E402
from lightning_ciuic.planner.config import optimizers_of  # noqa: E402
from lightning_ciuic.planner.train_step import StepSpec, token_batch, train_steps  # noqa: E402

WARMUP = 5
WORLD, DP, TP = 4, 2, 2
MiB = 2**20
SETTINGS = {False: "replicated (sequence_parallel=False)", True: "sequence + loss parallel (default)"}


def llama(hidden: int, layers: int, vocab: int) -> HuggingFaceCausalLM:
    """A Llama of ``layers`` layers of width ``hidden`` (heads of 64, 2 query heads per key-value head, Llama's
    3.5x MLP), bf16-free: float32, as a CPU trains it."""
    heads = hidden // 64
    config = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(3.5 * hidden), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(TP, heads // 2), max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return HuggingFaceCausalLM("llama", config, lr=3e-4)


def config_of(sequence_parallel: bool) -> ParallelismConfig:
    return ParallelismConfig(data_parallel_size=DP, tensor_parallel_size=TP, sequence_parallel=sequence_parallel)


# -- 1. memory ------------------------------------------------------------------------------------------------------
def planned_activations(args: argparse.Namespace, sequence_parallel: bool) -> int:
    """The plan's activations of the most loaded rank."""

    def build(mesh):
        with torch.device("meta"):
            return llama(args.hidden, args.layers, args.vocab)

    plan = plan_layout(
        build, config_of(sequence_parallel), WORLD, optimizers=optimizers_of,
        step=StepSpec(args.micro_batch_size, args.sequence_length),
    )
    return max(c.activations for c in plan.classes)


def _measured_rank(rank: int, args: argparse.Namespace, sequence_parallel: bool, port: int, out: str) -> None:
    """One real rank: parallelize, the engine and two steps tracked by MemTracker (the planner's own loop)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        config = config_of(sequence_parallel)
        meshes = config.resolve(WORLD).build("cpu")
        seed_everything(0)
        module = llama(args.hidden, args.layers, args.vocab)
        parallelized = parallelize(module, meshes, config)
        engine = build_engine(parallelized, config)
        batch = token_batch(module, StepSpec(args.micro_batch_size, args.sequence_length), torch.device("cpu"))
        memory = train_steps(
            module, engine, optimizers_of(module), batch, meshes.world, loss_parallel=parallelized.loss_parallel
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps({"activations": memory.activations, "peak": memory.peak}))
    finally:
        dist.destroy_process_group()


def measured_activations(args: argparse.Namespace, sequence_parallel: bool, workdir: Path) -> int:
    """A real 4-process run's activations (MemTracker's), of the most loaded rank."""
    out = workdir / f"measured-{sequence_parallel}"
    out.mkdir()
    mp.start_processes(
        _measured_rank, args=(args, sequence_parallel, free_port(), str(out)), nprocs=WORLD, start_method="spawn"
    )
    return max(json.loads((out / f"rank{r}.json").read_text())["activations"] for r in range(WORLD))


def memory_section(args: argparse.Namespace, command: str, label: str, workdir: Path) -> str:
    figures = {}
    for sequence_parallel in SETTINGS:
        figures[sequence_parallel] = (
            planned_activations(args, sequence_parallel), measured_activations(args, sequence_parallel, workdir)
        )
        print(f"sequence_parallel={sequence_parallel}: planned, measured {figures[sequence_parallel]}", flush=True)
    (plan_off, real_off), (plan_on, real_on) = figures[False], figures[True]
    ratios = plan_on / plan_off, real_on / real_off
    verdict = "met" if max(ratios) <= 0.6 else "not met"
    rows = "\n".join(
        f"| {SETTINGS[sp]} | {planned / MiB:.1f} | {measured / MiB:.1f} |" for sp, (planned, measured) in figures.items()
    )
    return f"""### Activations per rank

Command: `{command}`
({label}; dp 2 x tp 2 on 4 CPU processes, gloo; one micro-batch of {args.micro_batch_size} x {args.sequence_length}
tokens, float32, AdamW; a step's peak less the model states held after it, the largest rank's; planned: the step phase
on torch's fake process group; measured: the same `parallelize()` and steps on real tensors, torch's `MemTracker`;
machine: {machine()}). Target: sequence + loss parallel <= 0.6x of replicated.

| setting | planned MiB | measured (MemTracker) MiB |
|---|---:|---:|
{rows}
| **ratio** | **{ratios[0]:.2f}** | **{ratios[1]:.2f}** |

{verdict.capitalize()} (target <= 0.6 by both figures). Where it goes: the logits are halved (each rank holds its half of
the vocabulary), and torch's `loss_parallel()` backward, which held three logits-sized buffers at once beside the saved
log-probabilities (the step's peak), runs in one (`compat.loss_parallel_backward_in_place`; the peak is now the
log-softmax's forward); the norms, residuals and their float32 copies hold half the sequence; the column-parallel
linears reading a gathered input keep the rank's half of it for backward and gather it again there (`parallel/regather.py`, Megatron-LM's layout; torch's `ColwiseParallel` keeps
the gathered whole). Before those two (2026-12-05): 0.65 by both figures, 0.63 with the linears' change alone.
"""


# -- 2. step time ---------------------------------------------------------------------------------------------------
class RandomTokens(Dataset):
    """Deterministic token windows within the vocabulary: (inputs, next-token targets)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def timed_fit(args: argparse.Namespace, sequence_parallel: bool, out: Path) -> float:
    """One ``Trainer.fit`` on 4 processes; rank 0's median step time after the warm-up."""
    seed_everything(0)
    strategy = HybridParallelStrategy(
        data_parallel_size=DP, tensor_parallel_size=TP, sequence_parallel=sequence_parallel, start_method="spawn"
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[StepTimer(str(out))],
    )
    data = RandomTokens(args.steps * args.micro_batch_size * DP, args.sequence_length, args.vocab)
    trainer.fit(llama(args.hidden, args.layers, args.vocab), DataLoader(data, batch_size=args.micro_batch_size))
    return median_after_warmup(json.loads(out.read_text())["times"], WARMUP)


def time_section(args: argparse.Namespace, command: str, label: str, workdir: Path) -> str:
    times: dict[bool, list[float]] = {sp: [] for sp in SETTINGS}
    for round_ in range(args.rounds):
        for sequence_parallel in SETTINGS:
            times[sequence_parallel].append(timed_fit(args, sequence_parallel, workdir / f"time-{sequence_parallel}.json"))
            print(f"round {round_}: sequence_parallel={sequence_parallel} {times[sequence_parallel][-1] * 1e3:.1f} ms", flush=True)
    ratios = [on / off for on, off in zip(times[True], times[False])]
    ratio = statistics.median(ratios)
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    return f"""### Step time

Command: `{command}`
({label}; dp 2 x tp 2 on 4 CPU processes, 1 intra-op thread each, gloo; batch {args.micro_batch_size} x
{args.sequence_length} tokens per data-parallel rank; median step time after {WARMUP} warm-up steps of {args.steps},
{args.rounds} alternating rounds; ratios paired within a round; machine: {machine()}). Target: <= 1.1.

| replicated ms/step (median) | sequence + loss parallel ms/step (median) | ratio: median (spread) | per round |
|---:|---:|---|---|
| {statistics.median(times[False]) * 1e3:.1f} | {statistics.median(times[True]) * 1e3:.1f} | **{ratio:.3f}** ({spread}; {'met' if ratio <= 1.1 else 'not met'}) | {', '.join(f'{r:.3f}' for r in ratios)} |
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", nargs="+", default=["memory", "time"], choices=["memory", "time"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 64 x tp (heads of 64 split over tp)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    args = parser.parse_args()
    if args.hidden % (64 * TP) or args.sequence_length % TP:
        raise SystemExit(f"--hidden must be a multiple of {64 * TP} and --sequence-length of {TP}")
    if "time" in args.parts and args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP} warm-up steps")
    command = shlex.join([".venv/bin/python", "benchmarks/sequence_parallel.py", *sys.argv[1:]])
    label = describe(llama(args.hidden, args.layers, args.vocab), f"Llama {args.layers} x {args.hidden}, vocabulary {args.vocab}")
    parts = {"memory": memory_section, "time": time_section}
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:  # each part its own section, so running one part keeps the other's figures
            markdown = parts[part](args, command, label, Path(tmp))
            if part == "memory":
                markdown = "## Sequence and loss parallelism at tp=2 (issue 47)\n\n" + markdown
            print(markdown) if args.no_write else write_section(f"sequence_parallel_{part}", markdown)

if __name__ == "__main__":
    main()
