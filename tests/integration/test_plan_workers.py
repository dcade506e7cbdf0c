"""The step phase's worker processes (``--processes``): they step pipeline stages whatever autograd has done in the
planner's process, a failure in one reaches the caller as one line naming the stage, and planning leaves this
process's ``sys.excepthook`` as it found it."""

import functools
import multiprocessing
import os
import sys
import warnings

import pytest
import torch

from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.pipeline_module import PipelineConfig
from lightning_ciuic.planner import plan_layout
from lightning_ciuic.planner.config import optimizers_of
from tests.integration.test_plan import STEP, _deep_llama

# Three stages of one layer each: stage 0 is stepped here, stages 1 and 2 in two worker processes.
PIPELINE = ParallelismConfig(pipeline_parallel_size=3, pipeline=PipelineConfig("1f1b", num_microbatches=3))
BUILD = functools.partial(_deep_llama, layers=3)


class _Nested(torch.autograd.Function):
    """Identity whose backward runs the backward of another ``_Nested``, ``depth`` deep."""

    @staticmethod
    def forward(ctx, x, depth):
        ctx.depth = depth
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.depth:
            with torch.enable_grad():
                inner = torch.ones(1, requires_grad=True)
                torch.autograd.grad(_Nested.apply(inner, ctx.depth - 1).sum(), inner)
        return grad, None


def _start_autograds_threads():
    """Leave autograd's threads started in this process, as the first backward of a CUDA build of torch with a GPU
    does (its device threads): a backward nested deeper than autograd's limit for re-entrant backwards (60) goes on
    in a thread of autograd's pool. From then on, autograd refuses to run in a process forked from this one (for the
    rest of the session, as under CUDA: nothing in the suite forks and then runs autograd)."""
    x = torch.ones(1, requires_grad=True)
    _Nested.apply(x, 70).sum().backward()

    def forked_backward(queue):
        try:
            y = torch.ones(1, requires_grad=True)
            y.sum().backward()
            queue.put("ran")
        except RuntimeError as err:
            queue.put(str(err))

    fork = multiprocessing.get_context("fork")
    queue = fork.Queue()
    child = fork.Process(target=forked_backward, args=(queue,))
    child.start()
    said = queue.get(timeout=120)
    child.join()
    assert "autograd's threading" in said, said  # the state the issue met: a forked worker's backward dies


def test_a_pipeline_steps_its_stages_in_workers_after_autograds_threads_started_in_this_process():
    """Stages 1 and 2 stepped in two worker processes after this process started autograd's threads (see above):
    forked workers' backwards died ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"); the workers now start with nothing of this process's, and give the figures of stepping every
    stage here."""
    _start_autograds_threads()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the step phase steps its pipeline stages one at a time")  # workers
        in_workers = plan_layout(BUILD, PIPELINE, 3, optimizers=optimizers_of, step=STEP, processes=2)
    here = plan_layout(BUILD, PIPELINE, 3, optimizers=optimizers_of, step=STEP)
    assert sorted(in_workers.steps) == [0, 1, 2]
    assert in_workers.steps == here.steps  # activations, FLOPs, bytes per collective, each axis's group ranks
    assert [(c.ranks, c.peak) for c in in_workers.classes] == [(c.ranks, c.peak) for c in here.classes]


def _build_failing_in_workers(mesh):
    if multiprocessing.parent_process() is not None:  # a worker process of the step phase
        raise RuntimeError("no module in a worker\nsecond line of the message")
    return BUILD(mesh)


def test_a_failure_in_a_worker_is_one_line_naming_the_stage_its_rank_and_the_error():
    from lightning_ciuic.planner.workers import StageStepFailed

    with pytest.raises(StageStepFailed) as caught:
        plan_layout(_build_failing_in_workers, PIPELINE, 3, optimizers=optimizers_of, step=STEP, processes=2)
    failed = caught.value
    assert str(failed) == (
        "pipeline stage 1 (rank 1) failed in its step worker process: RuntimeError: no module in a worker"
    ), str(failed)
    assert failed.__cause__ is None and "_build_failing_in_workers" in failed.worker_traceback  # the rest, kept


def _build_dying_in_workers(mesh):
    if multiprocessing.parent_process() is not None:
        os._exit(9)  # as the kernel's OOM killer ends a process: no exception, no clean-up
    return BUILD(mesh)


def test_a_worker_that_dies_is_one_line_too():
    from lightning_ciuic.planner.workers import StageStepFailed

    with pytest.raises(StageStepFailed) as caught:
        plan_layout(_build_dying_in_workers, PIPELINE, 3, optimizers=optimizers_of, step=STEP, processes=2)
    said = str(caught.value)
    assert "\n" not in said and said.startswith(
        "pipeline stage 1 (rank 1) failed in its step worker process: a worker process ended abruptly"
    ) and said.endswith("processes=1 (--processes 1) steps every stage in this process."), said


def _build_warning_in_workers(mesh):
    if multiprocessing.parent_process() is not None:
        warnings.warn("built in a worker", UserWarning)
    return BUILD(mesh)


def test_a_warning_raised_in_a_worker_is_shown_by_the_planners_process():
    with pytest.warns(UserWarning, match="built in a worker") as warned:
        plan_layout(_build_warning_in_workers, PIPELINE, 3, optimizers=optimizers_of, step=STEP, processes=2)
    assert {w.filename for w in warned if "built in a worker" in str(w.message)} == {__file__}


def test_one_line_of_a_wrapped_error_is_its_first_line_and_its_root_causes():
    """What torch's pipeline stage raises when a backward fails: a message that starts on its second line, wrapping
    the error that says why (each line perhaps under torch's "[rank<r>]:" prefixes)."""
    from lightning_ciuic.planner.workers import one_line

    try:
        try:
            raise RuntimeError("[rank1]: [rank0]: Unable to handle autograd's threading in combination with fork-based"
                               " multiprocessing.\n[rank1]: [rank0]: See the wiki")
        except RuntimeError as cause:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: (...)") from cause
    except RuntimeError as err:
        said = one_line(err)
    assert said == (
        "RuntimeError: Failed to run stage backward: (caused by RuntimeError: Unable to handle autograd's threading in"
        " combination with fork-based multiprocessing.)"
    ), said


def test_the_command_says_a_failed_stage_in_one_line(monkeypatch, capsys):
    from lightning_ciuic import planner
    from lightning_ciuic.cli import plan_command
    from lightning_ciuic.planner.workers import StageStepFailed

    def failing(*args, **kwargs):
        raise StageStepFailed(5, 640, "RuntimeError: Failed to run stage backward: (caused by RuntimeError: boom)", "tb")

    monkeypatch.setattr(planner, "plan", failing)
    assert plan_command(["--config", "examples/configs/hf_llama.yaml", "--world-size", "4"]) == 3
    assert capsys.readouterr().err == (
        "the step phase failed: pipeline stage 5 (rank 640) failed in its step worker process: RuntimeError: Failed to"
        " run stage backward: (caused by RuntimeError: boom)\n"
    )


def test_planning_leaves_the_processs_excepthook_as_it_was():
    """torch's init_process_group wraps sys.excepthook to put "[rank<r>]:" before every line of an uncaught
    traceback; a plan makes a fake group per rank it builds, and the prefixes piled up ("[rank2]: [rank1]: ...")."""
    hook = sys.excepthook
    plan_layout(BUILD, PIPELINE, 3, optimizers=optimizers_of)
    assert sys.excepthook is hook
