"""The step phase's worker processes: pipeline stages stepped at once, in processes that inherit nothing.

Contract: :func:`step_stages` runs ``step(stage)`` for each stage, here, or in up to ``processes`` worker processes
started by ``forkserver`` (``spawn`` where there is none: Windows), never by ``fork``. A forked process inherits its
parent's autograd as it is, and autograd refuses to run in a child forked after its threads started ("Unable to handle
autograd's threading in combination with fork-based multiprocessing"): under a CUDA build of torch with a GPU, the
parent's first backward starts them, and the planner steps stage 0 in its own process before the others. A worker
here starts from a fresh interpreter (the forkserver's, which imports torch, Lightning and the pack once:
:func:`~lightning_ciuic.strategies.launchers.preload_forkserver`), so its autograd is its own whatever the planner's
process has run.

Such a worker has nothing of the planner's state but ``step``, pickled once and handed to each worker as it starts:
``step`` carries everything a stage's step reads (the module factory, the layout, the optimizers, the micro-batch,
the extrapolation depth and the stages' boundaries found by stage 0), and each step sets up its own fake process
group and fake-tensor mode (:func:`~lightning_ciuic.planner.step.step_figures`). Functions pickle by name: a module
factory defined in a script must be importable from it (a script that plans under ``if __name__ == "__main__":``,
as multiprocessing asks of any script whose workers spawn). Where ``step`` does not pickle (a closure, a lambda), the
stages are stepped here, one at a time, with a warning saying what did not pickle and what would.

A failure in a worker reaches the caller as one :class:`StageStepFailed`, one line: the stage, its rank, and the
error's type and first line (with its root cause's, where it wraps one); the worker's traceback is kept on it
(``worker_traceback``). A worker that dies (killed, out of memory) fails the same way, naming the first stage it left
unstepped. The warnings a worker's step raises are shown by the caller's process, as if raised there (its filters,
each once per place it is raised from, stage 0's included), not by each worker again.

No Lightning imports at import time.
"""

from __future__ import annotations

import multiprocessing
import pickle
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional

START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

Step = Callable[[int], Any]  # stage -> its figures; with ``rank(stage)``, the rank it steps


class StageStepFailed(RuntimeError):
    """A pipeline stage's step failed in a worker process; ``str()`` is one line, ``worker_traceback`` the rest."""

    def __init__(self, stage: int, rank: Optional[int], error: str, worker_traceback: str = "") -> None:
        where = f"pipeline stage {stage}" + (f" (rank {rank})" if rank is not None else "")
        super().__init__(f"{where} failed in its step worker process: {error}")
        self.stage, self.rank, self.error, self.worker_traceback = stage, rank, error, worker_traceback

    def __reduce__(self) -> tuple:
        return StageStepFailed, (self.stage, self.rank, self.error, self.worker_traceback)


_RANK_PREFIX = re.compile(r"^(\s*\[rank\d+\]:)+\s*")  # what torch's excepthook puts before each line


def _first_line(error: BaseException) -> str:
    lines = [_RANK_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    return next((line for line in lines if line), "(no message)")


def one_line(error: BaseException) -> str:
    """``Type: first line`` of ``error``, and of the exception at the root of its chain where there is one."""
    said = f"{type(error).__name__}: {_first_line(error)}"
    root, seen = error, {id(error)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__
        seen.add(id(root))
    if root is not error:
        said += f" (caused by {type(root).__name__}: {_first_line(root)})"
    return said


def _rank_of(step: Step, stage: int) -> Optional[int]:
    rank = getattr(step, "rank", None)
    return rank(stage) if callable(rank) else None


_PICKLED_STEP: Optional[bytes] = None  # a worker's step, as handed to it
_STEP: Optional[Step] = None  # ... once unpickled (at its first stage)


def _install(pickled: bytes) -> None:
    """A worker's initializer: keep the step; it is unpickled at the first stage, where a failure can be reported."""
    global _PICKLED_STEP
    _PICKLED_STEP = pickled


Warned = tuple[str, type, str, int]  # a warning's message, category, file and line


def _step_in_worker(stage: int) -> tuple[Any, list[Warned]]:
    """``stage``'s figures, and the warnings its step raised (each once), for the planner's process to show."""
    global _STEP
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if _STEP is None:
                assert _PICKLED_STEP is not None
                _STEP = pickle.loads(_PICKLED_STEP)
            figures = _STEP(stage)
        warned = {(str(w.message), w.category, w.filename, w.lineno): None for w in caught}
        return figures, list(warned)
    except Exception as err:  # noqa: BLE001 - every failure goes back as one picklable line, with its traceback
        rank = _rank_of(_STEP, stage) if _STEP is not None else None
        raise StageStepFailed(stage, rank, one_line(err), traceback.format_exc()) from None


def _show(warned: list[Warned]) -> None:
    """Warnings a worker's step raised, shown here as if raised here: under this process's filters, each once per
    place it was raised from (the place's module's registry, which also holds what stage 0's step showed here)."""
    modules = {getattr(m, "__file__", None): m for m in list(sys.modules.values())}
    for message, category, filename, lineno in warned:
        module = modules.get(filename)
        if module is None:
            warnings.warn_explicit(message, category, filename, lineno, registry=_ELSEWHERE)
        else:
            registry = vars(module).setdefault("__warningregistry__", {})
            warnings.warn_explicit(message, category, filename, lineno, module=module.__name__, registry=registry)


_ELSEWHERE: dict = {}  # the registry of warnings raised in files no module of this process was loaded from


def _pickled(step: Step) -> Optional[bytes]:
    """``step`` pickled, or None (and a warning saying why) where it does not pickle."""
    try:
        return pickle.dumps(step)
    except Exception as err:  # noqa: BLE001 - pickle raises several types (PicklingError, AttributeError, TypeError)
        warnings.warn(
            f"the step phase steps its pipeline stages one at a time in this process: its worker processes start"
            f" with nothing of this one's (never forked: autograd refuses to run in a process forked after its"
            f" threads started), and the step does not pickle ({type(err).__name__}: {err}). Give a module factory"
            f" and an optimizer factory that pickle (module-level functions, functools.partial of them, or objects of"
            f" module-level classes) to step stages in parallel, or processes=1 to step them here without this"
            f" warning.",
            stacklevel=3,
        )
        return None


def step_stages(stages: Sequence[int], step: Step, processes: int) -> dict[int, Any]:
    """``step(stage)`` for each of ``stages``: here, or with ``processes > 1`` in that many worker processes (see the
    module docstring); a failure in a worker raises :class:`StageStepFailed`."""
    stages = list(stages)
    pickled = _pickled(step) if processes > 1 and len(stages) > 1 else None
    if pickled is None:
        return {stage: step(stage) for stage in stages}
    if START_METHOD == "forkserver":
        from lightning_ciuic.strategies.launchers import preload_forkserver

        preload_forkserver()  # takes effect where this process's forkserver is not running yet
    figures: dict[int, Any] = {}
    before = set(multiprocessing.active_children())
    with ProcessPoolExecutor(
        min(processes, len(stages)), mp_context=multiprocessing.get_context(START_METHOD),
        initializer=_install, initargs=(pickled,),
    ) as pool:
        futures = {stage: pool.submit(_step_in_worker, stage) for stage in stages}
        try:
            for stage, future in futures.items():
                try:
                    figures[stage], warned = future.result()
                except StageStepFailed as err:
                    raise err from None  # without the worker's traceback chained to it (err.worker_traceback has it)
                except BrokenProcessPool:
                    raise StageStepFailed(
                        stage, _rank_of(step, stage),
                        "a worker process ended abruptly (killed? out of memory?) before this stage's step was done;"
                        " processes=1 (--processes 1) steps every stage in this process.",
                    ) from None
                except Exception as err:  # noqa: BLE001 - e.g. figures that did not pickle back: one line too
                    raise StageStepFailed(stage, _rank_of(step, stage), one_line(err)) from None
                _show(warned)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in set(multiprocessing.active_children()) - before:  # the stages still stepping: not waited for
                worker.terminate()
            raise
    return figures
