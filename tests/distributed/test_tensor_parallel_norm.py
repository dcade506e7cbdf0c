"""Global gradient norm across tensor-parallel shards equals the single-process norm."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_ciuic import apply_tensor_parallel
from lightning_ciuic.parallel.grad_norm import clip_grad_norm_
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


def test_global_norm_clipping_across_tp_shards():
    run_workers(_clip_matches_single_process, 2)
