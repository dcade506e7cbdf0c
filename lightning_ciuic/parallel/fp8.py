"""FP8 GEMMs: a linear layer's forward and input-gradient products in float8 e4m3 with a scale per row, on torch's
``_scaled_mm``; its weight gradient in the input's own dtype (torchao's ``rowwise_with_gw_hp`` recipe).

Contract:

* :func:`fp8_linear(x, weight, bias=None)` is ``x @ weight.T + bias`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``)
  with, in forward, each row of ``x`` (a token) and each row of ``weight`` (an output channel) divided by its scale
  (its largest magnitude over 448, e4m3's largest) and cast to e4m3, multiplied with float32 accumulation (torch's
  ``_scaled_mm``: :func:`~lightning_ciuic.compat.scaled_mm`), the output in ``x``'s dtype (the autocast dtype under
  autocast; float64 comes out of a float32 product). In backward, the input's gradient ``grad @ weight`` is the same
  product of ``grad``'s rows (tokens) and ``weight``'s columns (input channels), each so cast; the weight's gradient
  ``grad.T @ x`` and the bias's are computed in ``x``'s dtype, not quantized. Every scale belongs to one token or to
  one channel of the weight, none to the batch: a token's output and input gradient do not depend on the tokens
  beside it, and the weight's gradient sums unquantized products, so a layout that splits the batch computes what
  one process computes, up to the order of its sums. ``x`` is saved before the product runs, as ``nn.Linear``'s
  product saves it.
* :class:`Fp8Linear`: an ``nn.Linear`` whose forward is :func:`fp8_linear`.
* :func:`weight_gradients_deferred`: the context of a zero-bubble schedule's input pass (the pipeline's stages enter
  it), inside which the weights' gradients wait for the weight pass.
* :func:`use_fp8_gemms(blocks, names, experts=())`: every ``nn.Linear`` inside ``blocks`` (not a block that is one: a
  pipeline's output head) becomes an :class:`Fp8Linear` in place (its class swapped: the same parameters, state dict
  and hooks), except a mixture-of-experts router (an ``nn.Linear`` beside packed experts,
  :func:`~lightning_ciuic.parallel.experts.layout.packed_experts`), which stays in its dtype as DeepSeek-V3 keeps its
  gating; returns the converted modules' names. Raises ``ValueError`` naming the linears (and the packed experts
  given, which multiply in FP8 under expert parallelism) whose widths are not multiples of :data:`FP8_DIMENSION`
  (CUDA's FP8 kernels need them), or a linear with a ``forward`` of its own, or when the blocks hold no linear.
  Embeddings, norms, attention's own products and the output head are not ``nn.Linear`` inside the blocks, and stay
  in their dtype, as DeepSeek-V3 keeps them.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import nn

from lightning_ciuic import compat
from lightning_ciuic.parallel.experts.layout import experts_parent, packed_experts

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_DIMENSION = 16  # every width of an FP8 GEMM a multiple of it
_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantized_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)``: each row of the 2-D ``t`` over its own scale (``[rows, 1]``, float32: its largest magnitude
    over 448), in e4m3; ``codes * scales`` is ``t`` to e4m3's precision. An all-zero row gets scale 1."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float()
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (t.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def fp8_product(a: torch.Tensor, b_rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b_rows.T`` for 2-D ``a`` ``[M, K]`` and ``b_rows`` ``[N, K]``, each row of either quantized
    (:func:`quantized_rows`), accumulated in float32, in ``out_dtype``."""
    a_codes, a_scales = quantized_rows(a)
    b_codes, b_scales = quantized_rows(b_rows)
    product_dtype = out_dtype if out_dtype in _OUTPUT_DTYPES else torch.float32
    product = compat.scaled_mm(a_codes, b_codes.t(), a_scales, b_scales.t(), product_dtype)
    return product.to(out_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by FP8 GEMMs (see the module docstring). Two autograd functions: the first keeps ``x``
    for the weight's gradient and computes it, the second multiplies (its backward the input's gradient) and hands
    it the output's gradient. ``x`` is saved before the product runs, as ``nn.Linear``'s product saves its inputs: a
    recomputation that needs ``x`` back (torch's checkpointing stops once what backward reads is back) does not run
    the product too. ``x``'s gradient goes from the product to ``x``; the first function passes only the weight on,
    and the product gives it a weight-shaped zero that takes no memory (an expanded scalar) for a gradient: a
    zero-bubble schedule's input pass keeps, for the weight pass, what reaches the first function (torch's
    ``stage_backward_input``: the gradients into the first node that reads both a weight and the stage's input),
    so it keeps that zero and the output gradient the product handed over, as it keeps ``nn.Linear``'s output
    gradient, and not ``x``'s gradient besides."""
    handoff = _OutputGradient()
    kept_weight = _WeightGradient.apply(x, weight, handoff)
    return _Fp8Product.apply(x, kept_weight, bias, handoff)


_DEFERRED = threading.local()


@contextlib.contextmanager
def weight_gradients_deferred() -> Iterator[None]:
    """Inside (a zero-bubble schedule's input pass), an FP8 linear's backward passes its input's gradient on and keeps
    the output gradient; the weight pass, which runs its backward again from there (torch's
    ``stage_backward_weight``), computes the weight's gradient."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = before


class _OutputGradient:
    """The product's output gradient, from :class:`_Fp8Product`'s backward to :class:`_WeightGradient`'s (which
    autograd runs after it: the product reads the other's outputs)."""

    grad: Optional[torch.Tensor] = None


class _WeightGradient(torch.autograd.Function):
    """``weight`` as it is, ``x`` kept; in backward, the weight's gradient computed from the output gradient the
    product handed over, in ``x``'s dtype (``x``'s own gradient is the product's)."""

    @staticmethod
    def forward(ctx, x, weight, handoff):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.handoff, ctx.weight_dtype = handoff, weight.dtype
        ctx.set_materialize_grads(False)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, _zero):  # type: ignore[override]
        if getattr(_DEFERRED, "on", False):
            return None, None, None  # the output gradient stays for the weight pass, which runs this again
        grad_weight, rows = None, ctx.handoff.grad
        ctx.handoff.grad = None
        if ctx.needs_input_grad[1] and rows is not None:
            (x,) = ctx.saved_tensors
            grad_weight = (rows.to(x.dtype).t() @ x.reshape(-1, x.shape[-1])).to(ctx.weight_dtype)
        return None, grad_weight, None


class _Fp8Product(torch.autograd.Function):
    """``x @ weight.T + bias`` by FP8 GEMMs; in backward, ``x``'s gradient by FP8 GEMMs and the bias's, the output
    gradient handed to :class:`_WeightGradient`. The weight is held, not saved: autograd packs what a function saves
    once its forward has run, and a recomputation that needed it back would run the product again (a parameter's
    storage outlives the step; FSDP2 refills the same storage for backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, handoff):  # type: ignore[override]
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        ctx.weight = weight.detach()
        ctx.handoff, ctx.x_shape, ctx.x_dtype, ctx.has_bias = handoff, x.shape, x.dtype, bias is not None
        out = fp8_product(x.reshape(-1, x.shape[-1]), weight, out_dtype).reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        weight = ctx.weight
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = zero = grad_bias = None
        if ctx.needs_input_grad[1]:
            ctx.handoff.grad = rows
            zero = weight.new_zeros(()).expand(weight.shape)  # for the weight's node (fp8_linear's docstring)
        if ctx.needs_input_grad[0]:
            grad_x = fp8_product(rows, weight.t(), ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(weight.dtype)
        return grad_x, zero, grad_bias, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose products are FP8 GEMMs (:func:`fp8_linear`); made by :func:`use_fp8_gemms`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_linear(input, self.weight, self.bias)


def use_fp8_gemms(blocks: Sequence[nn.Module], names: Sequence[str], experts: Sequence[tuple[str, nn.Module]] = ()) -> list[str]:
    """Every ``nn.Linear`` of ``blocks`` (named ``names``) but the routers an :class:`Fp8Linear` (module docstring);
    ``experts``: the ``(name, module)`` of packed experts that will multiply in FP8 too, whose widths are checked
    with the linears'."""
    routers = {
        id(child)
        for block in blocks
        for name, _ in packed_experts(block)
        for child in experts_parent(block, name).children()
        if isinstance(child, nn.Linear)
    }
    linears = [
        (f"{block_name}.{name}", module)
        for block, block_name in zip(blocks, names)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear) and module is not block and id(module) not in routers
    ]
    widths = [(f"{name} ({m.in_features} -> {m.out_features})", (m.in_features, m.out_features)) for name, m in linears]
    widths += [(f"{name} (hidden {m.down_proj.shape[-2]}, intermediate {m.down_proj.shape[-1]})", m.down_proj.shape[-2:])
               for name, m in experts]
    odd = [what for what, dims in widths if any(d % FP8_DIMENSION for d in dims)]
    if odd:
        raise ValueError(
            f"gemm_precision='fp8' multiplies every linear layer of the blocks in FP8, whose kernels need widths that"
            f" are multiples of {FP8_DIMENSION}; these are not: {', '.join(odd)}. Give them such widths, or leave"
            " gemm_precision at its default."
        )
    if not linears:
        raise ValueError(
            "gemm_precision='fp8' multiplies the blocks' nn.Linear layers in FP8, and the blocks hold none: leave"
            " gemm_precision at its default."
        )
    own_forward = [f"{name} ({type(m).__name__})" for name, m in linears if type(m).forward is not nn.Linear.forward
                   and not isinstance(m, Fp8Linear)]
    if own_forward:
        raise ValueError(
            f"gemm_precision='fp8' replaces nn.Linear's forward, and these linear layers have their own:"
            f" {', '.join(own_forward)}. Use nn.Linear there, or leave gemm_precision at its default."
        )
    for _, module in linears:
        module.__class__ = _fp8_class(type(module))
    return [name for name, _ in linears]


@functools.cache
def _fp8_class(cls: type) -> type:
    """``cls`` (an ``nn.Linear`` with nn.Linear's forward) with :class:`Fp8Linear`'s forward."""
    if issubclass(cls, Fp8Linear):
        return cls
    if cls is nn.Linear:
        return Fp8Linear
    return type(f"Fp8{cls.__name__}", (Fp8Linear, cls), {})
