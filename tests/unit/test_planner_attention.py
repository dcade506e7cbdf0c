"""Attention in the planner's fake step: its FLOPs counted whichever kernel runs it, and multi-head latent attention
held as CUDA's memory-efficient kernel holds it, not as the CPU's math path does."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ciuic import compat
from lightning_ciuic.planner.flops import LocalFlops


def _attention(length: int, value_dim: int, fake: bool, held_as_cuda: bool, mask: bool = False):
    """One attention forward and backward of 4 heads of 24-dim queries and keys: (output shape, gradient shapes,
    FLOPs counted, bytes autograd saved for the backward)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with (FakeTensorMode() if fake else contextlib.nullcontext(),
          compat.attention_held_as_cuda_holds_it() if held_as_cuda else contextlib.nullcontext()):
        q, k = (torch.randn(2, 4, length, 24, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 4, length, value_dim, requires_grad=True)
        attn_mask = torch.ones(length, length, dtype=torch.bool).tril() if mask else None
        with LocalFlops() as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not mask)
            out.sum().backward()
        return tuple(out.shape), [tuple(t.grad.shape) for t in (q, k, v)], flops.total, sum(saved.values())


def _products(length: int, dims: int) -> int:
    """FLOPs of one product of L x S per head contracting ``dims`` (2 sequences, 4 heads)."""
    return 2 * (2 * 4 * length * length) * dims


def test_the_cpus_flash_attention_counts_its_flops():
    """Forward: the scores and the output (two products); backward: the scores again (a fused kernel recomputes them)
    and four more. The math path keeps the scores, and runs four products backward."""
    flash = _attention(64, 24, fake=False, held_as_cuda=False)
    with sdpa_kernel(SDPBackend.MATH):
        math = _attention(64, 24, fake=False, held_as_cuda=False)
    assert flash[2] == 7 * _products(64, 24)
    assert math[2] == 6 * _products(64, 24)


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "boolean-mask"])
def test_latent_attention_is_held_as_cudas_memory_efficient_kernel_holds_it(mask):
    """Values of 16 dims under 24-dim queries: the CPU's math path saves the L x L weights (quadratic in L); held as
    CUDA holds it, what is saved grows with L, with the same shapes, and the FLOPs of a fused kernel."""
    as_cpu = {n: _attention(n, 16, fake=True, held_as_cuda=False, mask=mask) for n in (64, 128)}
    as_cuda = {n: _attention(n, 16, fake=True, held_as_cuda=True, mask=mask) for n in (64, 128)}
    for n in (64, 128):
        assert as_cuda[n][:2] == as_cpu[n][:2]  # output and gradient shapes
        # math: forward q.k and p.v; backward p.dO, dO.v, dS.k, dS.q
        assert as_cpu[n][2] == 3 * _products(n, 24) + 3 * _products(n, 16)
        # fused: the same and q.k again backward
        assert as_cuda[n][2] == 4 * _products(n, 24) + 3 * _products(n, 16)
        inputs = 2 * 4 * n * (24 + 24 + 16) * 4
        assert as_cpu[n][3] >= inputs + 2 * 4 * n * n * 4  # the weights, 2 x 4 x L x L floats
        # the inputs, the output and a log-sum-exp per query and head, two random-state scalars (and the additive
        # mask CUDA's kernel takes)
        assert as_cuda[n][3] == inputs + 2 * 4 * n * 16 * 4 + 2 * 4 * n * 4 + 2 * 8 + (n * n * 4 if mask else 0)


def test_attention_of_one_head_dim_goes_on_as_before():
    assert _attention(64, 24, fake=True, held_as_cuda=True) == _attention(64, 24, fake=True, held_as_cuda=False)
