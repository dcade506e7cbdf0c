"""HybridParallelStrategy's processes and meshes: the launcher, the process group, the layout's meshes.

Contract (each function takes the strategy and works on it):

* :func:`configure_launcher`: in the launching process, before any worker starts, the rules between the arguments
  and the devices (``ParallelismConfig.check_devices``; ``sync_batchnorm`` needs CUDA/XPU) and the layout against
  the world (``ParallelismConfig.resolve``: the error names every factor); then the launcher: none where the cluster
  starts the processes or one process runs in the caller's, Lightning's script launcher for ``"popen"``,
  :class:`~lightning_ciuic.strategies.launchers.FullWeightsMultiProcessingLauncher` otherwise.
* :func:`start`: in each rank, the world ranks, the process group (gloo on CPU, NCCL on CUDA unless
  ``process_group_backend`` says otherwise; a ``HashStore`` for one process, the restarted-worker store otherwise),
  the exit and set-up vote, the intra-op threads on a shared CPU (as torchrun does), then the layout's
  :class:`~lightning_ciuic.parallel.dims.Meshes`, built once (``strategy.meshes``; the LightningModule's
  ``device_mesh`` is their ``world``), and the data-parallel world the loaders split their data by.
* :func:`device_type`: the kind of device the ranks compute on, known before any process has its own.
* :func:`teardown`: the engine closed, the pipeline and the data-parallel world forgotten, a meta-built model in the
  launching process (after a failed launch) allocated on the CPU, Lightning's teardown, then, in a one-process run in
  the caller's process, the process group this strategy created destroyed (a later Trainer, or the caller's own
  ``init_process_group``, starts afresh; a multi-rank worker exits instead: :mod:`~lightning_ciuic.parallel.shutdown`).

Lightning is imported here (the strategy's glue), not below in ``parallel/``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_ciuic import compat
from lightning_ciuic.data.world import set_data_parallel_world
from lightning_ciuic.parallel.fsdp import has_meta_tensors
from lightning_ciuic.parallel.shutdown import leave_at_exit, setup_vote_group
from lightning_ciuic.strategies.launchers import FullWeightsMultiProcessingLauncher
from lightning_ciuic.strategies.rendezvous import restarted_worker_store

if TYPE_CHECKING:
    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy


def device_type(strategy: HybridParallelStrategy) -> str:
    """The kind of device the ranks compute on, known before any process has its own (custom devices: their type)."""
    devices = strategy.parallel_devices or []
    return str(getattr(devices[0], "type", "cpu")) if devices else "cpu"


def configure_launcher(strategy: HybridParallelStrategy) -> None:
    assert strategy.cluster_environment is not None
    kind = device_type(strategy)  # the devices' kind: this rank's own device is not known yet
    strategy.parallelism.check_devices(kind)  # before any process starts
    if compat.layer_sync(strategy) is not None and kind == "cpu":
        raise ValueError(
            "Trainer(sync_batchnorm=True) converts batch norm layers to torch's SyncBatchNorm, which runs on CUDA"
            " (and XPU) devices only, and this run computes on the CPU: leave sync_batchnorm off (each replica"
            " then normalises by its own batch's statistics), or run on GPUs."
        )
    # Fail in the launching process, before any worker starts, when the layout cannot fit the world.
    strategy.parallelism.resolve(strategy.num_nodes * strategy.num_processes)
    if strategy.cluster_environment.creates_processes_externally:
        return
    if strategy._start_method == "popen" and strategy.num_nodes * strategy.num_processes == 1:
        # One process runs here, in the caller's process: Lightning's script launcher would only set LOCAL_RANK,
        # NODE_RANK, ... in the caller's environment, and the next Trainer there would take itself for a launched
        # rank (spawn, fork and forkserver still start their one process, as DDPStrategy's do).
        return
    if strategy._start_method == "popen":
        script_launcher = compat.launchers()[0]
        compat.set_launcher(strategy, script_launcher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes))
    else:
        compat.set_launcher(strategy, FullWeightsMultiProcessingLauncher(strategy, start_method=strategy._start_method))


def set_world_ranks(strategy: HybridParallelStrategy) -> None:
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = strategy.global_rank


def start(strategy: HybridParallelStrategy) -> None:
    """This rank's part of ``setup_environment`` after Lightning's (see the module docstring)."""
    set_world_ranks(strategy)
    init_process_group(strategy)
    leave_at_exit()
    # here, where every rank passes (parallel/shutdown.py); a quiet rank exits 1 in the process the user ran
    setup_vote_group(strategy._timeout, quiet_exit_code=1 if getattr(strategy.launcher, "procs", None) else 0)
    if strategy.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Like torchrun: several ranks on one machine must not each take every core (oversubscribed
        # intra-op threads make CPU collectives several times slower).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, strategy.num_processes)))
    strategy.parallel_dims = strategy.parallelism.resolve(strategy.world_size)
    strategy.meshes = strategy.parallel_dims.build(strategy.root_device.type)
    set_data_parallel_world(strategy.data_parallel_world)
    rank_zero_info(f"HybridParallelStrategy: {strategy.parallel_dims}, backend {strategy.process_group_backend}")
    if strategy.lightning_module is not None:  # set up without a module too (collectives only), as DDPStrategy is
        compat.set_module_device_mesh(strategy.lightning_module, strategy.meshes.world)  # LightningModule.device_mesh


def init_process_group(strategy: HybridParallelStrategy) -> None:
    if dist.is_initialized():
        return
    strategy._created_process_group = True
    assert strategy.cluster_environment is not None
    if strategy.world_size == 1:  # no peer to meet: no port taken, nothing set in the caller's environment
        store: Optional[dist.Store] = dist.HashStore()
    else:
        os.environ["MASTER_ADDR"] = strategy.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(strategy.cluster_environment.main_port)
        store = restarted_worker_store(strategy.world_size, strategy._timeout)
    dist.init_process_group(
        strategy.process_group_backend, rank=strategy.global_rank, world_size=strategy.world_size,
        timeout=strategy._timeout, store=store,
    )


def teardown(strategy: HybridParallelStrategy, lightning_teardown: Callable[[], None]) -> None:
    """See the module docstring; ``lightning_teardown`` is Lightning's ``teardown`` of the strategy."""
    strategy._close_data_parallel()
    strategy.pipeline = None
    set_data_parallel_world(None)
    module = strategy.lightning_module
    if module is not None and has_meta_tensors(module):
        # Lightning's teardown moves the module to the CPU, which a meta tensor cannot do: allocate it
        # (uninitialised pages cost nothing here).
        module.to_empty(device="cpu")
    lightning_teardown()
    if strategy._created_process_group and strategy.world_size == 1 and dist.is_initialized():
        dist.destroy_process_group()
        strategy._created_process_group = False
        strategy.meshes = None
