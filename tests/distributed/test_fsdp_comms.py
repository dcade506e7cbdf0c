"""The int8 reduce-scatter FSDP2 can use (qgZ): each rank's row of the sum, within the codec's error bound, and
error feedback that makes two steps' sum exact up to the last step's quantization."""

import torch
import torch.distributed as dist

from lightning_ciuic.comm.codecs import BlockInt8
from lightning_ciuic.comm.fsdp_comms import QuantizedReduceScatter
from lightning_ciuic.comm.grad_sync import SyncStats
from tests.helpers import run_workers

N = 1000  # values per rank's row: not a multiple of the codec's 256-value blocks


def _gradients(rank: int, world: int, step: int) -> torch.Tensor:
    return torch.randn(world * N, generator=torch.Generator().manual_seed(100 * step + rank))


def _quantized_reduce_scatter(rank, world):
    stats = SyncStats()
    comm = QuantizedReduceScatter(BlockInt8(), error_feedback=True, stats=stats)
    group = dist.group.WORLD
    outputs = []
    for step in range(2):
        out = comm.allocate((N,), dtype=torch.float32, device=torch.device("cpu"))
        comm(output_tensor=out, input_tensor=_gradients(rank, world, step), group=group, op=dist.ReduceOp.AVG)
        outputs.append(out)
        exact = sum(_gradients(r, world, step) for r in range(world)).view(world, N)[rank] / world
        # Each sender's int8 error is at most absmax(block) / 254 per value (step 1 also carries step 0's residual,
        # at most that much again: hence the factor 2).
        bound = sum(_gradients(r, world, step).abs().max() for r in range(world)) / 254 / world
        assert (out - exact).abs().max() <= 2 * bound
    assert comm.residual is not None and comm.residual.abs().max() > 0  # what int8 dropped, kept for the next step
    # With error feedback the two steps' outputs add up to the exact two-step sum, less only the residual still held.
    exact_two = sum(_gradients(r, world, s) for r in range(world) for s in range(2)).view(world, N)[rank] / world
    held = torch.empty(world * N)
    dist.all_reduce(held.copy_(comm.residual), group=group)
    assert torch.allclose(outputs[0] + outputs[1] + held.view(world, N)[rank] / world, exact_two, atol=1e-5)
    assert stats.collectives == 2 and stats.bytes_sent == 2 * (world - 1) * BlockInt8().nbytes(N)


def test_int8_reduce_scatter_with_error_feedback():
    run_workers(_quantized_reduce_scatter, 2)
