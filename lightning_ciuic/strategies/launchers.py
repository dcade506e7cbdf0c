"""Launchers of HybridParallelStrategy: Lightning's, with two differences for spawn/fork/forkserver.

``FullWeightsMultiProcessingLauncher`` is Lightning's multiprocessing launcher, except that the weights it
hands back to the main process after ``fit`` are the full model: tensor-parallel DTensors are gathered on
every rank first, because the main process has no device mesh to rebuild them on, and under pipeline
parallelism the stages' parameters are gathered from the ``pp`` axis; a main-process module still on the meta
device (built with ``empty_init=True`` for sharding) is allocated to receive them. And a worker that finished leaves its
process groups together with its peers before its process exits (:mod:`lightning_ciuic.parallel.shutdown`: a gloo
worker thread still busy at interpreter exit aborts the process now and then).

``forkserver`` ranks are forked from a server process that imported torch, Lightning and this pack once
(:func:`preload_forkserver`), where ``spawn`` imports them again in every rank: a launch in a tenth of a second
instead of seconds (``benchmarks/launch.py``). A forked rank has the server's environment, standard streams and random state,
not the caller's, so :class:`ForkserverHandoff` hands it the caller's, as a spawned rank inherits or gets them from
Lightning: the environment (``PL_GLOBAL_SEED``, ``MASTER_PORT``, ...), stdout and stderr (file descriptors 1 and 2),
the deterministic flags and random states; and the launcher unshares a CPU module from the caller's memory, as
Lightning does under spawn. Not handed: what torch read once at import in the server (``ATEN_CPU_CAPABILITY``).

A set-up that failed (:func:`~lightning_ciuic.parallel.shutdown.agree_on_setup`), or a block voted on the same way
after it (:func:`~lightning_ciuic.parallel.shutdown.reported_once`: a checkpoint restore, a callback's refusal at fit
start), reaches the caller once, as itself:
the lowest failing rank hands its exception to the main process in place of rank 0's results (with a note saying
where it was raised), the other ranks return quietly, and ``Trainer.fit`` in the main process raises that exception,
its type and message unchanged, instead of torch's ``ProcessRaisedException`` wrapping a worker's traceback. An
exception that does not survive pickling, or pickles to more than 16 KiB, is raised in its worker as before
(``ProcessRaisedException``, the other ranks still quiet).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback
from multiprocessing import reduction
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_ciuic import compat
from lightning_ciuic.parallel.fsdp import has_meta_tensors, materialize
from lightning_ciuic.parallel.shutdown import (
    PeerSetupFailed, is_reported_setup_failure, leave_process_groups, leave_without_peers,
)
from lightning_ciuic.parallel.axes import Axis


_, MultiProcessingLauncher, WorkerOutput = compat.launchers()
GlobalStateSnapshot, unshare_module_memory = compat.spawn_handoff()

# What a forkserver imports once, before it forks any rank ("__main__": multiprocessing's default).
FORKSERVER_PRELOAD = ("__main__", "torch", "torch.distributed", "lightning.pytorch", "lightning_ciuic")


def preload_forkserver() -> None:
    """Have this process's forkserver import :data:`FORKSERVER_PRELOAD` before it forks ranks. Takes effect when the
    server starts: at the first forkserver launch of the process."""
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))


class ForkserverHandoff:
    """What a forkserver rank takes over from the process that launched it, as a spawned rank inherits it: the
    environment as it is now, stdout and stderr (the file descriptors, passed to the rank when it is launched), and
    ``global_state`` (Lightning's deterministic flags and random states) where given. Made in the caller, pickled
    with the rank's arguments; the rank calls :meth:`apply` first."""

    def __init__(self, global_state: Any = None) -> None:
        self.environ, self.global_state, self._streams = dict(os.environ), global_state, None

    def __reduce__(self) -> tuple:
        # reduction.DupFd while a rank is being launched: the descriptor travels with it, as multiprocessing's own
        # connections do.
        return _rebuilt_handoff, (self.environ, self.global_state, (reduction.DupFd(1), reduction.DupFd(2)))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        if self._streams is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            for target, stream in zip((1, 2), self._streams):
                fd = stream.detach()
                os.dup2(fd, target)
                os.close(fd)
            self._streams = None
        if self.global_state is not None:
            self.global_state.restore()


def _rebuilt_handoff(environ: dict, global_state: Any, streams: tuple) -> ForkserverHandoff:
    handoff = ForkserverHandoff.__new__(ForkserverHandoff)
    handoff.environ, handoff.global_state, handoff._streams = environ, global_state, streams
    return handoff


class WorkerSetupFailure:
    """What the lowest failing rank hands the main process when its set-up failed: the exception, pickled."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_HANDOVER_LIMIT = 16384  # bytes: the main process reads the queue only once every rank has exited, so what a rank
# puts must fit the pipe's buffer (64 KiB on Linux) or the rank would wait forever to exit


def _handed_over(error: BaseException, rank: int) -> Optional[WorkerSetupFailure]:
    """``error`` with a note of where it was raised, ready for the queue; ``None`` where it does not survive pickling
    or is too large for it (an exception holding a model, ...)."""
    frames = traceback.extract_tb(error.__traceback__)
    if frames and hasattr(error, "add_note"):  # Python >= 3.11
        frame = frames[-1]
        error.add_note(f"(raised on rank {rank} at {frame.filename}:{frame.lineno}, in {frame.name})")
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        return None
    return WorkerSetupFailure(error) if len(data) <= _HANDOVER_LIMIT else None


class FullWeightsMultiProcessingLauncher(MultiProcessingLauncher):
    """Lightning's spawn/fork/forkserver launcher, except that the weights handed back to the main process are
    full tensors (tensor-parallel DTensors are gathered on every rank first: the main process has no mesh),
    finished workers destroy their process groups together before exiting, and a forkserver rank gets the
    caller's environment, streams and global state, as a spawned rank does."""

    _handoff: Optional[ForkserverHandoff] = None  # set while a forkserver launch is under way
    _fit_before = False  # _already_fit when the launch began: restored when a set-up failed

    @override
    def launch(self, function: Any, *args: Any, trainer: Optional[Trainer] = None, **kwargs: Any) -> Any:
        if self._start_method == "forkserver":
            preload_forkserver()
            # Lightning sets the port next, in this process; the rank must see it in the environment handed over.
            os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
            self._handoff = ForkserverHandoff(GlobalStateSnapshot.capture())
        self._fit_before = self._already_fit
        try:
            output = super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            self._handoff = None  # pickled with the ranks only: its descriptors travel with a launch
        if isinstance(output, WorkerSetupFailure):  # trainer=None: Lightning hands the worker output back as it is
            raise output.error
        return output

    @override
    def _wrapping_function(
        self, process_idx: int, trainer: Optional[Trainer], function: Any, args: Any, kwargs: Any,
        return_queue: Any, global_states: Any = None,
    ) -> None:
        if self._handoff is not None:
            self._handoff.apply()
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                args, kwargs = unshare_module_memory((args, kwargs))
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except PeerSetupFailed:  # a peer's set-up failed: it hands its error over, this rank says nothing
            leave_without_peers()
            return
        except Exception as error:
            failure = _handed_over(error, self._strategy.global_rank) if is_reported_setup_failure(error) else None
            if failure is None:
                raise
            return_queue.put(failure)  # in place of rank 0's results: no rank has any
            leave_without_peers()
            return
        leave_process_groups()

    @override
    def _recover_results_in_main_process(self, worker_output: WorkerOutput, trainer: Trainer) -> None:
        if isinstance(worker_output, WorkerSetupFailure):
            self._already_fit = self._fit_before  # nothing ran: this Trainer may fit again
            raise worker_output.error
        module = trainer.lightning_module
        if worker_output.weights_path is not None and has_meta_tensors(module):
            # Built on the meta device (sharded, empty_init=True): allocate it here so the trained weights load into
            # it; buffers outside the state dict (rotary tables, ...) get their initial values.
            materialize(module, torch.device("cpu"))
        super()._recover_results_in_main_process(worker_output, trainer)

    @override
    def get_extra_results(self, trainer: Trainer) -> dict[str, Any]:
        steps = (getattr(self._strategy, "fit_start_step", None), trainer.global_step)
        return {**super().get_extra_results(trainer), "fit_steps": steps}

    @override
    def update_main_process_results(self, trainer: Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        # this process's loops never ran: what the ranks trained, for the summary
        self._strategy.fit_start_step, self._strategy.fit_end_step = extra.get("fit_steps", (None, None))

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Optional[WorkerOutput]:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None)
        module = trainer.lightning_module
        if any(isinstance(p, DTensor) for p in module.parameters()):  # full tensors: the main process has no mesh
            state_dict = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        else:
            state_dict = module.state_dict()
        dims = getattr(self._strategy, "parallel_dims", None)
        if dims is not None and dims.pp_enabled:
            stages: list[Any] = [None] * dims.pp
            dist.all_gather_object(stages, state_dict, group=self._strategy.meshes.mesh(Axis.PP).get_group())
            state_dict = {key: value for stage in stages for key, value in stage.items()}
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

