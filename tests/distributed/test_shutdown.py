"""Leaving process groups at exit: gloo's worker threads are found and seen idle before the interpreter finalizes."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_ciuic.comm.groups import side_group
from lightning_ciuic.parallel import shutdown
from lightning_ciuic.telemetry import Telemetry
from tests.helpers import run_workers


def _threads_outlive_destroy_and_are_waited_for(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).full_tensor()
    assert len(shutdown._gloo_worker_activity()) >= 1  # the default group's workers
    dist.barrier()
    dist.destroy_process_group()
    # The mesh (and DTensor's caches) still hold the group: its workers live on after destroy_process_group.
    assert shutdown._gloo_worker_activity(), "torch now joins gloo's workers at destroy: the wait may be unneeded"
    assert shutdown.wait_for_idle_gloo_workers(timeout_s=5.0)
    assert all(state == "S" for state, _ in shutdown._gloo_worker_activity().values())


def test_gloo_workers_that_outlive_destroy_are_idle_before_exit():
    run_workers(_threads_outlive_destroy_and_are_waited_for, 2)


class _TrainerLike:
    def __init__(self) -> None:
        self.lightning_module = torch.nn.Linear(2, 2)


def _registers_leaving_at_exit(rank, world, how):
    shutdown._registered = False  # run_workers registered it for itself: see whether the pack's component does
    if how == "telemetry":
        Telemetry.of(_TrainerLike())
    else:
        side_group()
    assert shutdown._registered


@pytest.mark.parametrize("how", ["telemetry", "side_group"])
def test_a_process_whose_ranks_measure_or_vote_leaves_its_groups_at_exit(how):
    """Under Lightning's ddp_spawn the DDP wrapper holds the default group at exit, and a spawned rank aborted now and
    then (SIGABRT): `benchmarks/exit_aborts.py --runs 30` (2026-12-06) counted 16 of 30 bare runs, 0 of 30 with the
    pack's telemetry made in the rank. A side group (the step vote's, AsyncCheckpointer's) registers it as well."""
    run_workers(_registers_leaving_at_exit, 2, how)
