"""The experts' inputs (their rows, their SwiGLU's input) kept for backward in fp8 (DeepSeek-V3's low-precision
storage): the forward and the down-projection's gradient unchanged, the gradients that read those inputs within fp8's
rounding, about half of bf16's bytes kept, every other saved tensor still handed to the hooks outside (a
recomputation's), and nothing encoded under torch's checkpointing, which keeps nothing to encode."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.experts.gemm import run_local_experts
from lightning_ciuic.parallel.experts.layout import dispatch_codec
from lightning_ciuic.parallel.experts.storage import kept_encoded

FP8 = dispatch_codec("fp8")


class _Experts(torch.nn.Module):
    def __init__(self, n=3, hidden=256, inter=64, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n, 2 * inter, hidden, generator=g, dtype=dtype) / hidden**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(n, hidden, inter, generator=g, dtype=dtype) / inter**0.5)
        self.act_fn = torch.nn.SiLU()


def _step(experts, rows, counts, codec, wrap=None):
    rows = rows.detach().requires_grad_()
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().nbytes())
        return t

    def run():
        return run_local_experts(experts, rows, counts, 1.0, input_codec=codec)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # a recomputation's hooks, say
        out = wrap(run) if wrap else run()
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad(out, (rows, experts.gate_up_proj, experts.down_proj), grad)
    return out, grads, kept


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fp8_storage_changes_only_the_gradients_that_read_the_inputs_within_their_rounding(dtype):
    experts = _Experts(dtype=dtype)
    rows = torch.randn(40, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    counts = [15, 0, 25]
    exact, exact_grads, exact_kept = _step(experts, rows, counts, None)
    out, grads, kept = _step(experts, rows, counts, FP8)
    assert torch.equal(out, exact) and torch.equal(grads[2], exact_grads[2])  # the down-projection's input is kept as is
    for name, grad, expected in zip(("rows", "gate_up_proj"), grads, exact_grads):
        error = (grad - expected).abs().max() / expected.abs().max()
        assert 0 < error < 2**-3, (name, float(error))  # e4m3 has 3 mantissa bits: a few of its steps
    # the rows and the gate/up product no longer reach the hooks outside; everything else autograd keeps still does
    assert sum(kept) <= sum(exact_kept) - rows.numel() * rows.element_size() * (1 + 128 / 256), (exact_kept, kept)
    assert experts.down_proj.untyped_storage().nbytes() in kept and experts.gate_up_proj.untyped_storage().nbytes() in kept


def test_fp8_storage_keeps_about_half_of_bf16s_bytes():
    rows = torch.randn(4096, 1024, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 1024, dtype=torch.bfloat16, requires_grad=True)
    with kept_encoded(rows, FP8) as kept:
        torch.nn.functional.linear(rows, weight).sum().backward()
    encoded = sum(p.numel() * p.element_size() for p in kept.encoded.pieces)
    assert encoded == FP8.nbytes(rows.numel()) and 0.5 < encoded / (rows.numel() * 2) < 0.53


def test_under_torchs_checkpointing_nothing_is_encoded():
    experts = _Experts()
    rows = torch.randn(40, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, exact_grads, _ = _step(experts, rows, [15, 0, 25], None)
    _, grads, _ = _step(experts, rows, [15, 0, 25], FP8, wrap=lambda run: checkpoint(run, use_reentrant=False))
    assert all(torch.equal(a, b) for a, b in zip(grads, exact_grads))


def test_the_option_is_refused_where_it_would_keep_nothing_or_name_nothing():
    with pytest.raises(ValueError, match=r"expert_input_storage='fp8' with gradient_checkpointing='full': the blocks are recomputed"):
        ParallelismConfig(expert_parallel_size=2, expert_input_storage="fp8", gradient_checkpointing=True)
    with pytest.raises(ValueError, match=r"expert_input_storage='fp8' is how the expert-parallel experts .* expert_parallel_size=1"):
        ParallelismConfig(expert_input_storage="fp8")
    with pytest.raises(ValueError, match=r"expert_input_storage='e4m3': use one of \['none', 'bf16', 'fp8', 'int8'\]"):
        ParallelismConfig(expert_parallel_size=2, expert_input_storage="e4m3")
    ParallelismConfig(expert_parallel_size=2, expert_input_storage="fp8", gradient_checkpointing="full:2")


def test_the_loop_over_experts_decodes_each_experts_rows_once_and_alone():
    """float64 (and FP8 GEMMs) run the experts one after another: each one's rows are encoded apart, so its backward
    decodes its own rows, not every expert's."""
    decoded = []

    class Counted(type(FP8)):
        def decode(self, data, numel):
            decoded.append(numel)
            return super().decode(data, numel)

    codec = Counted(FP8.block)
    rows = torch.randn(40, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _step(_Experts(), rows, [15, 0, 25], codec)
    assert sorted(decoded) == sorted([15 * 256, 25 * 256, 15 * 128, 25 * 128]), decoded  # the rows, the gate/up products
