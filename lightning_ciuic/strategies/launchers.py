"""Launchers of HybridParallelStrategy: Lightning's, with one difference for spawn/fork.

``FullWeightsMultiProcessingLauncher`` is Lightning's multiprocessing launcher, except that the weights it
hands back to the main process after ``fit`` are the full model: tensor-parallel DTensors are gathered on
every rank first, because the main process has no device mesh to rebuild them on, and under pipeline
parallelism the stages' parameters are gathered from the ``pp`` axis; a main-process module still on the meta
device (built with ``empty_init=True`` for sharding) is allocated to receive them. And a worker that finished leaves its
process groups together with its peers before its process exits (:mod:`lightning_ciuic.parallel.shutdown`: a gloo
worker thread still busy at interpreter exit aborts the process now and then).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_ciuic import compat
from lightning_ciuic.comm.sharded import has_meta_tensors, materialize
from lightning_ciuic.parallel.shutdown import leave_process_groups


_, MultiProcessingLauncher, WorkerOutput = compat.launchers()


class FullWeightsMultiProcessingLauncher(MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, except that the weights handed back to the main process are full
    tensors (tensor-parallel DTensors are gathered on every rank first: the main process has no mesh), and
    finished workers destroy their process groups together before exiting."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        leave_process_groups()

    @override
    def _recover_results_in_main_process(self, worker_output: WorkerOutput, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None and has_meta_tensors(module):
            # Built on the meta device (sharded, empty_init=True): allocate it here so the trained weights load into
            # it; buffers outside the state dict (rotary tables, ...) get their initial values.
            materialize(module, torch.device("cpu"))
        super()._recover_results_in_main_process(worker_output, trainer)

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Optional[WorkerOutput]:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None)
        state_dict = get_model_state_dict(trainer.lightning_module, options=StateDictOptions(full_state_dict=True))
        dims = getattr(self._strategy, "parallel_dims", None)
        if dims is not None and dims.pp_enabled:
            stages: list[Any] = [None] * dims.pp
            dist.all_gather_object(stages, state_dict, group=self._strategy.device_mesh["pp"].get_group())
            state_dict = {key: value for stage in stages for key, value in stage.items()}
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

