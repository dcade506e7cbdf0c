"""FP8 GEMMs (lightning_ciuic.parallel.fp8) against their definition in float64: each row of each operand over its own
scale in e4m3, products accumulated in float32; a token's result independent of the batch; the blocks' linear layers
converted but the routers, refused where the kernels cannot run them."""

import pytest
import torch
from torch import nn

from lightning_ciuic.parallel.fp8 import FP8, Fp8Linear, fp8_linear, quantized_rows, use_fp8_gemms

U32 = 2.0**-24  # float32's unit roundoff: the products accumulate in float32


def _dequantized_rows(t: torch.Tensor) -> torch.Tensor:
    """What the e4m3 codes of ``t``'s rows stand for, in float64."""
    amax = t.detach().abs().amax(-1, keepdim=True).double()
    scale = torch.where(amax > 0, (amax.float() / 448).double(), torch.ones_like(amax))
    return (t.double() / scale).clamp(-448, 448).to(FP8).double() * scale


def _close(actual: torch.Tensor, a: torch.Tensor, b_rows: torch.Tensor) -> None:
    """``actual`` is ``a @ b_rows.T`` of the dequantized operands, to float32 accumulation's error bound
    (``K u sum|a||b|`` per element, ``K`` the contracted length) plus the output's own rounding."""
    qa, qb = _dequantized_rows(a), _dequantized_rows(b_rows)
    expected = qa @ qb.T
    bound = a.shape[-1] * U32 * (qa.abs() @ qb.abs().T) + U32 * expected.abs()
    assert ((actual.double() - expected).abs() <= bound + 1e-30).all(), (actual.double() - expected).abs().max()


def test_forward_and_input_gradient_are_the_rows_quantized_products_and_the_weight_gradient_is_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g).mul_(torch.logspace(-3, 3, 64)).requires_grad_()  # rows of mixed magnitudes
    w = torch.randn(48, 64, generator=g).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    out = fp8_linear(x, w, b)
    assert torch.equal(out, fp8_linear(x, w) + b)
    _close(fp8_linear(x, w).reshape(-1, 48), x.detach().reshape(-1, 64), w.detach())
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    _close(x.grad.reshape(-1, 64), grad.reshape(-1, 48), w.detach().T)
    assert torch.equal(w.grad, grad.reshape(-1, 48).T @ x.detach().reshape(-1, 64))  # unquantized
    assert torch.equal(b.grad, grad.reshape(-1, 48).sum(0))


def test_a_tokens_result_does_not_depend_on_the_tokens_beside_it():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 32, generator=g).requires_grad_(), torch.randn(16, 32, generator=g)
    whole = fp8_linear(x, w)
    halves = torch.cat([fp8_linear(x[:3], w), fp8_linear(x[3:], w)])
    torch.testing.assert_close(halves, whole, rtol=0, atol=2 * U32 * whole.abs().max().item())


def test_an_expert_with_no_rows_has_an_empty_product_and_a_zero_weight_gradient():
    x, w = torch.zeros(0, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    out = fp8_linear(x, w)
    out.sum().backward()
    assert out.shape == (0, 16) and x.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros(16, 32))


def test_an_all_zero_row_is_zero_and_bf16_inputs_come_out_in_bf16():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1] = 1
    out = fp8_linear(x, torch.ones(16, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out[0], torch.zeros(16, dtype=torch.bfloat16))
    codes, scales = quantized_rows(x)
    assert codes.dtype == FP8 and scales[0].item() == 1.0


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)  # a router: beside packed experts, its width need not be a multiple
        self.experts = _Experts()


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 16))
        self.down_proj = nn.Parameter(torch.randn(4, 16, 16))
        self.act_fn = nn.SiLU()


class _Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.attn = nn.Linear(16, width)
        self.mlp = _Router()


def test_the_blocks_linears_become_fp8_but_the_router_and_the_head_and_keep_their_state():
    """The router beside the experts, and a block that is a linear layer (a pipeline's output head), stay."""
    blocks = [_Block(), _Block(), nn.Linear(16, 64)]
    state = {k: v.clone() for k, v in blocks[0].state_dict().items()}
    assert use_fp8_gemms(blocks, ["layers.0", "layers.1", "head"]) == ["layers.0.attn", "layers.1.attn"]
    assert type(blocks[0].attn) is Fp8Linear and type(blocks[0].mlp.gate) is nn.Linear and type(blocks[2]) is nn.Linear
    assert all(torch.equal(v, state[k]) for k, v in blocks[0].state_dict().items())
    x = torch.randn(3, 16)
    torch.testing.assert_close(blocks[0].attn(x), fp8_linear(x, blocks[0].attn.weight, blocks[0].attn.bias))


def test_widths_the_kernels_cannot_take_and_linears_with_their_own_forward_are_refused():
    with pytest.raises(ValueError, match=r"multiples of 16; these are not: layers\.0\.attn \(16 -> 12\)"):
        use_fp8_gemms([_Block(width=12)], ["layers.0"])

    class Scaled(nn.Linear):
        def forward(self, input):
            return 2 * super().forward(input)

    block = _Block()
    block.attn = Scaled(16, 16)
    with pytest.raises(ValueError, match=r"have their own: layers\.0\.attn \(Scaled\)"):
        use_fp8_gemms([block], ["layers.0"])
    with pytest.raises(ValueError, match="the blocks hold none"):
        use_fp8_gemms([nn.Sequential(nn.ReLU())], ["layers.0"])


def test_a_subclass_with_nn_linears_forward_is_converted_keeping_its_class():
    class Named(nn.Linear):
        pass

    block = _Block()
    block.attn = Named(16, 16)
    use_fp8_gemms([block], ["layers.0"])
    assert isinstance(block.attn, Named) and isinstance(block.attn, Fp8Linear)


def test_deepseeks_recomputation_runs_the_same_products_with_fp8_gemms():
    """transformers' DeepSeek-V3 under its recipe (norms and MLA up-projections recomputed): a step's FLOPs, recomputed
    forwards included, are the same with FP8 GEMMs as without. The recomputation that brings the attention's inputs
    back stops at the output projection's input: an FP8 linear saves it before its product runs, as nn.Linear does
    (saved after it, the product ran again: one output projection per layer)."""
    pytest.importorskip("transformers")
    from lightning_ciuic.huggingface import HuggingFaceCausalLM
    from lightning_ciuic.parallel.parallelize import named_blocks
    from lightning_ciuic.parallel.recompute import Recompute, recompute_blocks
    from lightning_ciuic.planner.flops import LocalFlops

    config = dict(  # the query's head dim equal to the values' (CPU's flash attention kernel: kept, as CUDA's)
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=64,
    )

    def step_flops(fp8: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        module = HuggingFaceCausalLM("deepseek_v3", config)
        blocks, names = named_blocks(module, "test")
        if fp8:
            use_fp8_gemms(blocks, names)
        recompute_blocks(blocks, Recompute.parse({"recompute": ["norm", "mla_up"]}), names)
        with LocalFlops() as flops:
            module(torch.randint(0, 256, (2, 64))).float().sum().backward()
        return flops.total, flops.fp8

    (plain, none), (fp8, in_fp8) = step_flops(False), step_flops(True)
    assert none == 0 < in_fp8 < fp8 == plain


def _mlp(fp8: bool) -> nn.Module:
    """Two linear layers with an activation between (seeded), FP8 or not."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32))
    if fp8:
        use_fp8_gemms([stage], ["stage"])
    return stage


def _held_between_the_passes(fp8: bool) -> tuple[int, dict]:
    """Bytes the step's memory tracker holds after a zero-bubble input pass through an MLP (torch's
    ``stage_backward_input``, what a pipeline stage runs), and the weights' gradients after the weight pass."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from lightning_ciuic import compat
    from lightning_ciuic.parallel.fp8 import weight_gradients_deferred

    stage = _mlp(fp8)
    x = torch.randn(128, 64, requires_grad=True)
    tracker = compat.memory_tracker(per_module=False)
    with tracker:
        out = stage(x)
        with weight_gradients_deferred():
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
        held = sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot("current").values())
    stage_backward_weight(stage.parameters(), groups)
    return held, {name: p.grad for name, p in stage.named_parameters()}


def test_an_input_pass_keeps_for_the_weight_pass_what_nn_linear_keeps():
    """Between a zero-bubble schedule's input and weight passes an FP8 linear holds what ``nn.Linear`` holds (its input
    and output gradient), not its input's gradient besides (the second linear's, 128 x 256 floats, which no other
    layer keeps: the activation's output gradient; it did, 2026-12-06); the weight pass then computes the weight
    gradients the full backward computes."""
    linear, _ = _held_between_the_passes(fp8=False)
    held, grads = _held_between_the_passes(fp8=True)
    assert held <= linear + 1024, (held, linear)
    stage = _mlp(fp8=True)
    stage(torch.randn(128, 64, requires_grad=True)).sum().backward()
    for name, p in stage.named_parameters():
        assert torch.equal(grads[name], p.grad), name
