"""The experts keep less for backward than autograd's own ops would, with the same values and gradients: the combine
sums and permutes rows as torch's ``index_add`` / ``index_copy`` do without keeping the ``[pairs, hidden]`` rows
those keep; the SwiGLU recomputes its activation; the routing weights multiply the ``[pairs, I]`` intermediate, so the
``[pairs, hidden]`` output is not kept for their gradient (float64 against torch's ops and a plain loop over the
experts; the saved tensors counted by autograd's saved-tensor hooks)."""

import torch

from examples.deepseek import PackedExperts
from lightning_ciuic.parallel.experts import dispatched_output
from lightning_ciuic.parallel.experts.gemm import gated
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
    index = torch.randint(0, 4, (n,), generator=g)
    return rows, index


def test_sum_rows_equals_index_add_and_keeps_the_index_only():
    rows, index = _rows()
    grad = torch.randn(4, rows.shape[1], dtype=torch.float64)
    ours, saved = _saved_storages(lambda: sum_rows(rows, index, 4))
    theirs, theirs_saved = _saved_storages(lambda: rows.new_zeros(4, rows.shape[1]).index_add(0, index, rows))
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.autograd.grad(ours, rows, grad)[0], torch.autograd.grad(theirs, rows, grad)[0])
    assert set(saved) == {index.untyped_storage().data_ptr()}
    assert rows.untyped_storage().data_ptr() in theirs_saved  # torch's keeps its source


def test_permuted_rows_equals_index_copy_and_keeps_the_index_only():
    rows, _ = _rows()
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1))
    grad = torch.randn_like(rows)
    ours, saved = _saved_storages(lambda: permuted_rows(rows, order))
    theirs = torch.empty_like(rows).index_copy(0, order, rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.autograd.grad(ours, rows, grad)[0], torch.autograd.grad(theirs, rows, grad)[0])
    assert rows.untyped_storage().data_ptr() not in saved and len(saved) == 1


def test_the_swiglu_keeps_its_input_and_weights_only_and_gives_autograds_gradients():
    """``gated`` keeps the gate/up product (and the weights) and recomputes ``act_fn(gate)`` in backward: the same
    output and gradient bits as autograd's own ``act_fn(gate) * up * w``, in bf16 as in float64, weights float32."""
    for dtype in (torch.float64, torch.bfloat16):
        hidden = torch.randn(6, 8, dtype=torch.float64).to(dtype).requires_grad_()
        weights = torch.rand(6, dtype=torch.float32, requires_grad=True)
        grad = torch.randn(6, 4, dtype=torch.float64).to(dtype)
        gate, up = hidden.chunk(2, dim=-1)
        for w in (None, weights):
            ours, saved = _saved_storages(lambda: gated(hidden, torch.nn.SiLU(), w))
            theirs = torch.nn.functional.silu(gate) * up
            theirs = theirs if w is None else theirs * w.to(dtype).unsqueeze(-1)
            assert torch.equal(ours, theirs)
            inputs = (hidden,) if w is None else (hidden, w)
            for a, b in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(theirs, inputs, grad)):
                assert a.dtype == b.dtype and torch.equal(a, b), (dtype, w is None)
            assert hidden.untyped_storage().data_ptr() in saved and len(saved) == (1 if w is None else 2)


def test_a_moe_layer_keeps_the_rows_its_experts_take_and_no_other_pair_by_hidden_tensor():
    """The experts' forward (one rank holding every expert) keeps the rows its experts take, not their outputs (the
    routing weights' gradient reads the intermediate) nor the weighted outputs: one ``[pairs, hidden]`` tensor; the
    same output and gradients as the experts' own forward within float64's rounding."""
    torch.manual_seed(0)
    experts = PackedExperts(4, 16, 8).double()
    hidden = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    top_k_weights = torch.rand(10, 2, dtype=torch.float64, requires_grad=True)
    out, saved = _saved_storages(lambda: dispatched_output(experts, hidden, top_k_index, top_k_weights))
    assert sorted(saved.values()).count(20 * 16 * 8) == 1  # 20 pairs of 16 float64 values
    expected = experts(hidden, top_k_index, top_k_weights)
    grad = torch.randn_like(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-14)
    inputs = (hidden, top_k_weights, *experts.parameters())
    for a, b in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
