"""Our codecs as torch DDP communication hooks on CPU/gloo, and the seed's GradientQuantizer."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_ciuic import GradientQuantizer, HybridParallelStrategy, register_compression_hook
from tests.helpers import run_workers


def _grads_with_hook(rank, world, mode, tolerance):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
    reference = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model)
    if mode == "quantizer":
        GradientQuantizer(bits=8).register(ddp)
    else:
        register_compression_hook(ddp, mode, powersgd_rank=8, compression_ratio=0.5)  # rank 8 >= rank of the 8-sample gradient: exact
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    exact_model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
    with torch.no_grad():
        for p, r in zip(exact_model.parameters(), reference):
            p.copy_(r)
    for r in range(world):
        xr = torch.randn(4, 16, generator=torch.Generator().manual_seed(r))
        (exact_model(xr).square().mean() / world).backward()
    scale = max(p.grad.abs().max().item() for p in exact_model.parameters())  # blocks span parameters
    for ours, exact in zip(model.parameters(), exact_model.parameters()):
        assert (ours.grad - exact.grad).abs().max().item() <= tolerance * scale + 1e-7, (mode, (ours.grad - exact.grad).abs().max().item() / scale)


@pytest.mark.parametrize("mode, tolerance", [("none", 1e-6), ("fp16", 1e-2), ("int8", 2e-2), ("nf4", 0.3), ("quantizer", 2e-2), ("powersgd", 1e-3)])
def test_ddp_hook_averages_gradients(mode, tolerance):
    run_workers(_grads_with_hook, 2, mode, tolerance)


def test_quantizer_names_and_errors():
    assert [GradientQuantizer(bits=b).mode for b in (16, 8, 4)] == ["fp16", "int8", "nf4"]
    with pytest.raises(ValueError, match=r"GradientQuantizer\(bits=3\): use one of \[4, 8, 16\]"):
        GradientQuantizer(bits=3)
    strategy = HybridParallelStrategy(communication_compression=GradientQuantizer(bits=4))
    assert strategy.parallelism.compression.mode == "nf4" and strategy.parallelism.compression.feedback_for("nf4")
