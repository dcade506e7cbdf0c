r"""Where a pipeline rank's memory peaks in the schedule: the planner's step, action by action.

Plans DeepSeek-V3 (``examples/configs/plan/deepseek_v3.yaml``, shortened to ``--layers`` MoE layers: every pipeline
rank but the first holds the same layers) over ``--pp`` pipeline ranks x ``--ep`` (16) data-parallel ranks, the
experts over them, with DeepSeek's recomputation recipe (or ``--recompute``) and ZeRO-1, under ``--schedule`` (with
``--gemm-precision fp8``: FP8 GEMMs), and records the memory the step's tracker holds after each action a stage runs
(torch's ``forward_one_chunk``, ``backward_one_chunk``: a full or an input backward, ``backward_weight_one_chunk``: a
weight backward). Per rank: the most it holds after an action, and which; the step's
peak (the tracker's, inside an action too), and during which action; the memory after the rank's last forward (the
end of the steady state, where every rank holds as many chunks as the order lets it); and the memory after each of its
last actions. Other arguments go to the plan as they are (``--trainer.strategy.init_args.expert_input_storage fp8``).
Writes the ``pipeline_memory_timeline_<schedule>`` section of docs/benchmarks.md (``..._fp8`` with FP8 GEMMs,
``..._deferred_<k>`` with ``--max-deferred``: the strategy's ``max_deferred_weight_backwards``, ``..._ep<n>`` with
``--ep``).

    .venv/bin/python benchmarks/pipeline_memory_timeline.py [--schedule dualpipev] [--pp 4] [--microbatches 8] \
        [--layers 14] [--gemm-precision fp8] [--max-deferred 1] [--ep 64] [plan arguments]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.pipelining import stage as pipeline_stage  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic import compat  # noqa: E402
from lightning_ciuic.planner import plan  # noqa: E402
from lightning_ciuic.planner.train_step import StepSpec  # noqa: E402

GiB = 2**30
ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def recorded_step(args: argparse.Namespace, extra: list[str]) -> dict[int, list[tuple[str, int, int, int, int]]]:
    """Per tracked step (one per rank the planner steps): (action, stage, micro-batch, bytes held after it, the step's
    peak so far: what it held at most, inside an action too)."""
    trackers: list = []
    events: dict[int, list[tuple[str, int, int, int, int]]] = defaultdict(list)
    make_tracker = compat.memory_tracker

    def tracked(*a, **k):
        tracker = make_tracker(*a, **k)
        trackers.append(tracker)
        return tracker

    def recording(method, letter):
        def run(self, *a, **k):
            out = method(self, *a, **k)
            held, peak = (
                sum(d.get("Total", 0) for d in trackers[-1].get_tracker_snapshot(kind).values()) for kind in ("current", "peak")
            )
            microbatch = a[0] if a else k.get("fwd_chunk_id", k.get("bwd_chunk_id"))  # torch's first parameter
            events[len(trackers)].append((letter, self.stage_index, microbatch, held, peak))
            return out

        return run

    originals = {name: getattr(pipeline_stage._PipelineStageBase, name) for name in ACTIONS}
    compat.memory_tracker = tracked
    for name, letter in ACTIONS.items():
        setattr(pipeline_stage._PipelineStageBase, name, recording(originals[name], letter))
    try:
        plan(
            "examples/configs/plan/deepseek_v3.yaml", world_size=args.ep * args.pp, step=StepSpec(1, args.sequence_length), cli_args=[
                "--trainer.strategy.init_args.gradient_checkpointing", args.recompute,
                "--trainer.strategy.init_args.zero_stage", "1",
                "--trainer.strategy.init_args.pipeline_parallel_size", str(args.pp),
                "--trainer.strategy.init_args.expert_parallel_size", str(args.ep),
                "--trainer.strategy.init_args.num_microbatches", str(args.microbatches),
                "--trainer.strategy.init_args.pipeline_schedule", args.schedule,
                "--model.init_args.config.num_hidden_layers", str(args.layers),
                "--model.init_args.config.first_k_dense_replace", "0",
                *(["--trainer.strategy.init_args.gemm_precision", args.gemm_precision] if args.gemm_precision else []),
                *(["--trainer.strategy.init_args.max_deferred_weight_backwards", str(args.max_deferred)] if args.max_deferred is not None else []),
                *extra,
            ],
        )
    finally:
        compat.memory_tracker = make_tracker
        for name, method in originals.items():
            setattr(pipeline_stage._PipelineStageBase, name, method)
    return events


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="dualpipev")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--recompute", default='{"recompute": ["norm", "mla_up"]}', help="gradient_checkpointing, as YAML")
    parser.add_argument("--gemm-precision", default=None, help="fp8: the strategy's FP8 GEMMs")
    parser.add_argument("--max-deferred", type=int, default=None, help="the strategy's max_deferred_weight_backwards")
    parser.add_argument("--ep", type=int, default=16, help="expert-parallel ranks, the data-parallel ranks of each stage")
    args, extra = parser.parse_known_args()  # the rest: the plan's own arguments (--trainer.strategy.init_args...)
    rows = []
    for rank, events in enumerate(recorded_step(args, extra).values()):
        stages = sorted({stage for _, stage, _, _, _ in events})
        peak = max(held for _, _, _, held, _ in events)
        at = next(f"{a}{s}.{m}" for a, s, m, held, _ in events if held == peak)
        inside = max(top for *_, top in events)
        during = next(f"{a}{s}.{m}" for a, s, m, _, top in events if top == inside)
        last_forward = max(i for i, (a, *_) in enumerate(events) if a == "F")
        tail = " ".join(f"{a}{s}.{m} {held / GiB:.1f}" for a, s, m, held, _ in events[last_forward:])
        rows.append(
            f"| {rank} | {stages} | **{peak / GiB:.2f}** after {at} | {inside / GiB:.2f} during {during} |"
            f" {events[last_forward][3] / GiB:.2f} | {(peak - events[last_forward][3]) / GiB:+.2f} | {tail} |"
        )
    command = shlex.join([".venv/bin/python", "benchmarks/pipeline_memory_timeline.py", *sys.argv[1:]])
    table = "\n".join(rows)
    fp8 = "_fp8" if args.gemm_precision == "fp8" else ""
    limited = ("" if args.max_deferred is None else f"_deferred_{args.max_deferred}") + ("" if args.ep == 16 else f"_ep{args.ep}")
    limit_text = "" if args.max_deferred is None else f", at most {args.max_deferred} weight backwards deferred"
    plan_text = f", plan arguments `{shlex.join(extra)}`" if extra else ""
    write_section(f"pipeline_memory_timeline_{args.schedule}{fp8}{limited}", f"""## Where a pipeline rank's memory peaks: {args.schedule}{" with FP8 GEMMs" if fp8 else ""}{limit_text}

Command: `{command}` (machine: {machine()}). The planner's step of DeepSeek-V3 with {args.layers} MoE layers over pp
{args.pp} x {args.ep}, {args.microbatches} micro-batches of 1 x {args.sequence_length} tokens, `gradient_checkpointing`
`{args.recompute}`, ZeRO-1, {args.schedule}{", FP8 GEMMs" if fp8 else ""}{limit_text}{plan_text}: the memory held (GiB, fake tensors, the step's tracker) after each action of a rank's
stages, and the step's peak (inside an action too). `F`: forward; `B`: full or input backward; `W`: weight backward; `<action><stage>.<micro-batch>`.

| rank | stages | most after an action | the step's peak | after its last forward | most after - that | from its last forward on |
|---|---|---|---|---|---|---|
{table}
""")
    print(table)


if __name__ == "__main__":
    main()
