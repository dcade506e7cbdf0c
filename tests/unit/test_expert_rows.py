"""The experts' combine sums and permutes rows with the values and gradients of torch's ``index_add`` /
``index_copy``, without autograd keeping the ``[pairs, hidden]`` tensors that torch's keep and backward never reads
(float64, against torch's own ops; the saved tensors counted by autograd's saved-tensor hooks)."""

import torch

from examples.deepseek import PackedExperts
from lightning_ciuic.parallel.experts import dispatched_output
from lightning_ciuic.parallel.experts.rows import permuted_rows, sum_rows


def _saved_storages(fn):
    """``fn()``'s result and the distinct storages autograd saved while it ran (data pointer -> bytes)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _rows(n=12, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, w, dtype=torch.float64, generator=g).requires_grad_()
    weights = torch.rand(n, dtype=torch.float64, generator=g).requires_grad_()
    index = torch.randint(0, 4, (n,), generator=g)
    return rows, weights, index


def test_sum_rows_equals_index_add_in_values_and_gradients():
    rows, weights, index = _rows()
    grad = torch.randn(4, rows.shape[1], dtype=torch.float64)
    ours = sum_rows(rows, index, 4, weights)
    theirs = rows.new_zeros(4, rows.shape[1]).index_add(0, index, rows * weights.unsqueeze(-1))
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(ours, (rows, weights), grad),
                                                 torch.autograd.grad(theirs, (rows, weights), grad)))
    unweighted = sum_rows(rows, index, 4)
    assert torch.equal(unweighted, rows.new_zeros(4, rows.shape[1]).index_add(0, index, rows))
    assert torch.equal(torch.autograd.grad(unweighted, rows, grad)[0], grad.index_select(0, index))
    assert torch.autograd.gradcheck(lambda r, w: sum_rows(r, index, 4, w), (rows, weights))


def test_sum_rows_keeps_no_product_and_only_what_each_gradient_reads():
    rows, weights, index = _rows()
    product_bytes = rows.numel() * rows.element_size()
    _, torch_saved = _saved_storages(lambda: rows.new_zeros(4, 5).index_add(0, index, rows * weights.unsqueeze(-1)))
    _, saved = _saved_storages(lambda: sum_rows(rows, index, 4, weights))
    assert sum(torch_saved.values()) - sum(saved.values()) == product_bytes  # torch's keeps the product besides
    assert set(saved) == {t.untyped_storage().data_ptr() for t in (rows, weights, index)}
    _, saved = _saved_storages(lambda: sum_rows(rows.detach(), index, 4, weights))  # weights' gradient only: rows
    assert set(saved) == {t.untyped_storage().data_ptr() for t in (rows, index)}
    _, saved = _saved_storages(lambda: sum_rows(rows, index, 4, weights.detach()))  # rows' gradient only: weights
    assert set(saved) == {t.untyped_storage().data_ptr() for t in (weights, index)}


def test_permuted_rows_equals_index_copy_and_keeps_the_index_only():
    rows, _, _ = _rows()
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1))
    grad = torch.randn_like(rows)
    ours, saved = _saved_storages(lambda: permuted_rows(rows, order))
    theirs = torch.empty_like(rows).index_copy(0, order, rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.autograd.grad(ours, rows, grad)[0], torch.autograd.grad(theirs, rows, grad)[0])
    assert rows.untyped_storage().data_ptr() not in saved and len(saved) == 1


def test_a_moe_layer_keeps_two_pair_by_hidden_tensors_not_three():
    """The experts' forward (one rank holding every expert) keeps the rows its experts take and the rows they give
    (the routing weights' gradient reads them), not the weighted rows besides."""
    torch.manual_seed(0)
    experts = PackedExperts(4, 16, 8).double()
    hidden = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    top_k_weights = torch.rand(10, 2, dtype=torch.float64, requires_grad=True)
    out, saved = _saved_storages(lambda: dispatched_output(experts, hidden, top_k_index, top_k_weights))
    pair_by_hidden = 20 * 16 * 8
    assert sorted(saved.values()).count(pair_by_hidden) == 2
    assert torch.allclose(out, experts(hidden, top_k_index, top_k_weights), rtol=0, atol=1e-12)


def test_the_swiglu_keeps_its_input_only_and_gives_the_same_gradients():
    """``gated`` (the experts' SwiGLU) keeps the gate/up product and recomputes ``act_fn(gate)`` in backward: the
    same output and gradient bits as autograd's own ``act_fn(gate) * up``, in bf16 as in float64."""
    from lightning_ciuic.parallel.experts.gemm import gated

    for dtype in (torch.float64, torch.bfloat16):
        hidden = torch.randn(6, 8, dtype=torch.float64).to(dtype).requires_grad_()
        grad = torch.randn(6, 4, dtype=torch.float64).to(dtype)
        ours, saved = _saved_storages(lambda: gated(hidden, torch.nn.SiLU()))
        gate, up = hidden.chunk(2, dim=-1)
        theirs, theirs_saved = _saved_storages(lambda: torch.nn.functional.silu(gate) * up)
        assert torch.equal(ours, theirs)
        assert torch.equal(torch.autograd.grad(ours, hidden, grad)[0], torch.autograd.grad(theirs, hidden, grad)[0])
        assert set(saved) == {hidden.untyped_storage().data_ptr()}
        assert len(theirs_saved) == 2  # the input and act_fn(gate)
