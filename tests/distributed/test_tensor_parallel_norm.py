"""Global gradient norm across tensor-parallel shards (and unreduced Partial shares) equals the single-process norm."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_ciuic import apply_tensor_parallel
from lightning_ciuic.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from tests.helpers import run_workers


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))


def _clip_matches_single_process(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = apply_tensor_parallel(_mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    total = clip_grad_norm_(model.parameters(), 0.1)

    reference = _mlp()
    reference(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.testing.assert_close(total, expected)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(full, ref.grad, msg=name)

    # A replicated parameter whose gradient is still each rank's unreduced share (Partial: a sequence-parallel norm's
    # weight under a zero-bubble schedule, which runs no gradient hook) counts as the norm of the shares' sum.
    weight = nn.Parameter(distribute_tensor(torch.zeros(6, dtype=torch.float64), mesh["tp"], [Replicate()]))
    share = torch.arange(6, dtype=torch.float64) * (rank + 1)  # summed over 2 ranks: 3 * arange(6)
    weight.grad = DTensor.from_local(share, mesh["tp"], [Partial()], run_check=False)
    torch.testing.assert_close(total_grad_norm([weight]), (3 * torch.arange(6, dtype=torch.float64)).norm())


def test_global_norm_clipping_across_tp_shards():
    run_workers(_clip_matches_single_process, 2)
