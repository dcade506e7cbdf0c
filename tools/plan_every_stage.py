"""Check the plan's alike-stage shortcut on a real config: the step phase run twice, in one process each.

Contract
--------
``python tools/plan_every_stage.py --config RUN.yaml --world-size N --micro-batch-size B --sequence-length S
[any fit override]``

Plans the config's layout once as ``lightning-ciuic plan`` does (the first and last of each group of alike pipeline
stages stepped, the others on the line through them: ``planner/step.py::alike_stages``) and once with every stage
stepped, both with ``processes=1``, and prints each one's wall time, the stages each stepped, and whether the two
plans' JSON (rank classes, per-stage figures, bytes per collective, FLOPs) are equal. Exits 1 when they differ.
Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lightning_ciuic.planner import plan_layout
from lightning_ciuic.planner import step as step_phase
from lightning_ciuic.planner.config import from_config, module_factory, optimizers_of


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--sequence-length", type=int, required=True)
    options, overrides = parser.parse_known_args(argv)
    run = from_config(options.config, overrides)
    build, spec = module_factory(run), step_phase.StepSpec(options.micro_batch_size, options.sequence_length)
    stepped: list[int] = []
    measure = step_phase.step_figures

    def counted(rank: int, *args: object, **kwargs: object) -> step_phase.StepFigures:
        stepped.append(rank)
        return measure(rank, *args, **kwargs)

    step_phase.step_figures = counted
    start = time.perf_counter()
    alike = plan_layout(build, run.parallelism, options.world_size, optimizers=optimizers_of, step=spec)
    alike_seconds, alike_ranks = time.perf_counter() - start, list(stepped)
    stepped.clear()
    start = time.perf_counter()
    every = plan_layout(build, run.parallelism, options.world_size, optimizers=optimizers_of)
    step_phase.run_step_phase(every, build, run.parallelism, optimizers_of, spec)
    every_seconds = time.perf_counter() - start
    per_stage = options.world_size // len(every.steps)
    print(f"alike stages at their ends: {alike_seconds:.0f} s, stages stepped {[r // per_stage for r in alike_ranks]}")
    print(f"every stage:                {every_seconds:.0f} s, stages stepped {[r // per_stage for r in stepped]}")
    equal = json.dumps(alike.to_json(), sort_keys=True) == json.dumps(every.to_json(), sort_keys=True)
    print(f"the two plans' JSON {'are equal' if equal else 'DIFFER'} ({len(every.classes)} rank classes)")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
