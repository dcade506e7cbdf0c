import math

import pytest
import torch

from lightning_ciuic.wire.codecs import NF4, NF4_LEVELS, BlockFP8, BlockInt8, ErrorFeedback, HalfPrecision, TopK, dense_codec
from lightning_ciuic.comm.powersgd import PowerSGD


def _x(n=5000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 10, n)


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 5000])
def test_int8_error_bound_and_size(n):
    codec, x = BlockInt8(), _x(n)
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.nbytes(n)
    err = (codec.decode(data, n) - x).abs()
    blocks = torch.nn.functional.pad(x, (0, (-n) % 256)).view(-1, 256).abs().amax(1)
    bound = blocks.repeat_interleave(256)[:n] / 254 + 1e-7
    assert (err <= bound).all()


@pytest.mark.parametrize("n", [1, 127, 128, 1000, 5000])
def test_fp8_relative_error_in_e4m3s_normal_range_and_size(n):
    codec, x = BlockFP8(), _x(n)
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.nbytes(n) == math.ceil(n / 128) * (4 + 128)
    decoded = codec.decode(data, n)
    scales = torch.nn.functional.pad(x, (0, (-n) % 128)).view(-1, 128).abs().amax(1).repeat_interleave(128)[:n] / 448
    normal = x.abs() >= scales * 2**-6  # e4m3's smallest normal, times the block's scale
    assert ((decoded - x).abs()[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-6)).all()
    assert ((decoded - x).abs()[~normal] <= scales[~normal] * 2**-10 * (1 + 1e-6)).all()  # subnormals: half their 2**-9 step


@pytest.mark.parametrize("n", [2, 63, 64, 1000, 5000])
def test_nf4_error_bound_and_size(n):
    codec, x = NF4(), _x(n)
    data = codec.encode(x)
    assert data.numel() == codec.nbytes(n)
    err = (codec.decode(data, n) - x).abs()
    blocks = torch.nn.functional.pad(x, (0, (-n) % 64)).view(-1, 64).abs().amax(1)
    assert (err <= 0.152 * blocks.repeat_interleave(64)[:n] + 1e-7).all()


@pytest.mark.parametrize("n", [64, 65_536 + 100, 3 * 65_536])  # one block; past one CPU slice; three slices
def test_nf4_is_the_nearest_level_times_absmax_across_slices(n):
    codec, x = NF4(), _x(n, seed=n)
    x[128:192] = 0.0  # an all-zero block stays zero
    blocks = torch.nn.functional.pad(x, (0, (-n) % 64)).view(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    normalized = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    nearest = (normalized[..., None] - NF4_LEVELS).abs().argmin(-1)
    expected = (NF4_LEVELS[nearest] * absmax).reshape(-1)[:n]
    torch.testing.assert_close(codec.decode(codec.encode(x), n), expected, rtol=0, atol=0)
    out = torch.ones(n)
    codec.decode_into(codec.encode(x), n, out, accumulate=True)
    torch.testing.assert_close(out, 1 + expected, rtol=0, atol=0)


def test_wire_sizes_against_fp32():
    n = 8_000_000
    assert BlockInt8().nbytes(n) / (4 * n) <= 0.27
    assert NF4().nbytes(n) / (4 * n) <= 0.15
    assert TopK(0.01).nbytes(n) / (4 * n) <= 0.03


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 2**-11), (torch.bfloat16, 2**-8)])
def test_half_precision_relative_error(dtype, bound):
    codec, x = HalfPrecision(dtype), _x()
    x = x[x.abs() > 1e-3]
    rel = ((codec.roundtrip(x) - x).abs() / x.abs()).max()
    assert rel <= bound


def test_zero_blocks_stay_zero():
    for codec in (BlockInt8(), BlockFP8(), NF4()):
        assert torch.equal(codec.roundtrip(torch.zeros(300)), torch.zeros(300))


def test_topk_keeps_the_largest():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = TopK(0.2).roundtrip(x)
    assert torch.equal(out, torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, 0]))


@pytest.mark.parametrize("codec", [BlockInt8(), NF4(), TopK(0.05)], ids=repr)
def test_error_feedback_makes_the_running_sum_track_the_true_sum(codec):
    feedback, true_sum, sent_sum = ErrorFeedback(), torch.zeros(2000), torch.zeros(2000)
    naive_sum = torch.zeros(2000)
    for step in range(50):
        g = _x(2000, seed=step)
        true_sum += g
        naive_sum += codec.roundtrip(g)
        compensated = g.clone()
        feedback.compensate_("b", compensated)
        sent = codec.roundtrip(compensated)
        feedback.settle("b", sent)
        sent_sum += sent
    # the gap is exactly the last residual, bounded by one step's error, while the naive gap accumulates
    torch.testing.assert_close(true_sum - sent_sum, feedback.residuals["b"], atol=1e-3, rtol=1e-3)
    assert (true_sum - sent_sum).norm() < 0.5 * (true_sum - naive_sum).norm()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TopK(0.0), r"compression_ratio must be in \(0, 1\], got 0.0"),
        (lambda: TopK(1.5), r"compression_ratio must be in \(0, 1\], got 1.5"),
        (lambda: PowerSGD(0), "powersgd_rank must be an integer >= 1 \\(4 is a common choice\\), got 0"),
        (lambda: dense_codec("int4"), "no dense codec named 'int4'"),
        (lambda: HalfPrecision(torch.float32), "HalfPrecision takes torch.float16 or torch.bfloat16"),
    ],
)
def test_bad_codec_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_powersgd_byte_count():
    shapes = [torch.Size([64, 32]), torch.Size([32]), torch.Size([3, 3])]
    assert PowerSGD(4).nbytes(shapes) == 4 * ((64 + 32) * 4 + 32 + 9)
    assert math.isclose(PowerSGD(4).nbytes([torch.Size([1024, 1024])]) / (4 * 1024 * 1024), 8 / 1024)


@pytest.mark.parametrize("codec", [BlockFP8(), BlockInt8(), NF4()], ids=lambda c: c.name)
def test_block_codecs_on_fake_tensors_run_in_one_piece_whatever_the_size(codec):
    """The planner's step encodes the expert dispatch on fake tensors: slicing them as the CPU's cache asks would cost
    a fake dispatch per op per slice (24 s a DeepSeek-V3 dispatch, minutes per layer); in one piece the ops are as
    few for 64 slices as for one, and the sizes those of a real encoding."""
    from lightning_ciuic import compat
    from lightning_ciuic.wire.codecs import CPU_SLICE

    class Ops(compat.TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (CPU_SLICE, 64 * CPU_SLICE + 100):
        with compat.fake_tensor_mode(allow_non_fake_inputs=True):
            x = torch.empty(n)
            Ops.count = 0
            with Ops():
                data = codec.encode(x)
                decoded = codec.decode(data, n)
        assert data.shape == (codec.nbytes(n),) and decoded.shape == (n,)
        counts.append(Ops.count)
    assert counts[1] <= counts[0] + 4, counts
