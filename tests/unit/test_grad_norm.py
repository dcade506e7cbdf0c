import math

import pytest
import torch

from lightning_ciuic.parallel.grad_norm import clip_grad_norm_, total_grad_norm


def _params_with_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7)), torch.nn.Parameter(torch.zeros(2))]
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=g)
    return params  # the last one has no gradient


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_matches_torch_on_plain_tensors(norm_type):
    ours, theirs = _params_with_grads(), _params_with_grads()
    total = clip_grad_norm_(ours, 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours[:2], theirs[:2]):
        torch.testing.assert_close(a.grad, b.grad)


def test_no_clipping_below_the_threshold():
    params = _params_with_grads()
    before = [p.grad.clone() for p in params[:2]]
    total = total_grad_norm(params)
    clip_grad_norm_(params, float(total) * 2)
    for p, g in zip(params[:2], before):
        assert torch.equal(p.grad, g)
