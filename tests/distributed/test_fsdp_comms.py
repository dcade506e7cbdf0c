"""The int8 collectives FSDP2 can use: the reduce-scatter (qgZ): each rank's row of the sum, within the codec's error
bound, and error feedback that makes two steps' sum exact up to the last step's quantization; the all-gather (qwZ):
every rank decodes the same weights, each part within the codec's bound of its sender's shard."""

import torch
import torch.distributed as dist

from lightning_ciuic.wire.codecs import BlockInt8
from lightning_ciuic.comm.fsdp_comms import AllGatherComm, ReduceScatterComm
from lightning_ciuic.wire.timing import DeviceClock
from lightning_ciuic.comm.grad_sync import SyncStats
from tests.helpers import run_workers

N = 1000  # values per rank's row: not a multiple of the codec's 256-value blocks


def _gradients(rank: int, world: int, step: int) -> torch.Tensor:
    return torch.randn(world * N, generator=torch.Generator().manual_seed(100 * step + rank))


def _quantized_reduce_scatter(rank, world):
    stats = SyncStats()
    comm = ReduceScatterComm(stats, DeviceClock(torch.device("cpu")), BlockInt8(), error_feedback=True)
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
    assert stats.scatter_seconds > 0 and stats.comm_seconds == stats.scatter_seconds and stats.gather_seconds == 0


def test_int8_reduce_scatter_with_error_feedback():
    run_workers(_quantized_reduce_scatter, 2)


def _quantized_all_gather(rank, world):
    stats = SyncStats()
    comm = AllGatherComm(stats, DeviceClock(torch.device("cpu")), BlockInt8())
    shards = [_gradients(r, world, 0)[:N].double() for r in range(world)]
    out = comm.allocate((world * N,), dtype=torch.float64, device=torch.device("cpu"))
    out[rank * N : (rank + 1) * N].copy_(shards[rank])  # FSDP2's input is this view of the output
    comm(output_tensor=out, input_tensor=out[rank * N : (rank + 1) * N], group=dist.group.WORLD)
    # Every part, this rank's own included, is its sender's shard as int8 decodes it: the same on every rank.
    expected = torch.cat([BlockInt8().roundtrip(s.float()).double() for s in shards])
    assert torch.equal(out, expected)
    assert 0 < (out - torch.cat(shards)).abs().max() <= max(s.abs().max() for s in shards) / 254
    # Raw bytes (parameters of mixed dtypes) are gathered as they are.
    raw = torch.arange(8, dtype=torch.uint8) + rank
    gathered = torch.empty(8 * world, dtype=torch.uint8)
    comm(output_tensor=gathered, input_tensor=raw, group=dist.group.WORLD)
    assert torch.equal(gathered, torch.cat([torch.arange(8, dtype=torch.uint8) + r for r in range(world)]))
    assert stats.collectives == 2 and stats.bytes_sent == (world - 1) * (BlockInt8().nbytes(N) + 8)
    assert stats.gather_seconds > 0 and stats.comm_seconds == stats.gather_seconds


def test_int8_all_gather_decodes_the_same_weights_everywhere():
    run_workers(_quantized_all_gather, 2)


def _plain_collectives(rank, world):
    stats = SyncStats()
    clock = DeviceClock(torch.device("cpu"))
    gradients = _gradients(rank, world, 0)
    out = torch.empty(N)
    ReduceScatterComm(stats, clock)(output_tensor=out, input_tensor=gradients.clone(), group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    exact = sum(_gradients(r, world, 0) for r in range(world)).view(world, N)[rank] / world
    assert torch.allclose(out, exact, atol=1e-6)
    gathered = torch.empty(world * N)
    AllGatherComm(stats, clock)(output_tensor=gathered, input_tensor=out, group=dist.group.WORLD)
    assert torch.allclose(gathered, sum(_gradients(r, world, 0) for r in range(world)) / world, atol=1e-6)
    # Ring figures: (w-1)/w of the scattered input, (w-1) shards of the gathered output, in float32.
    assert stats.collectives == 2 and stats.bytes_sent == 2 * (world - 1) * N * 4
    assert stats.gather_seconds > 0 and stats.scatter_seconds > 0


def test_plain_collectives_are_the_backends_timed_and_counted():
    run_workers(_plain_collectives, 2)
