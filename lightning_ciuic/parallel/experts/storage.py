"""The experts' inputs kept for backward in a codec's encoding: DeepSeek-V3's low-precision activation storage.

Contract: inside ``kept_encoded(rows, codec)``, a tensor autograd saves that is ``rows`` or a view of it is kept as
``codec``'s encoding of ``rows`` (``fp8``: e4m3 codes and a float32 scale per 128 values, 0.52x the bytes of bf16;
:func:`~lightning_ciuic.parallel.experts.layout.dispatch_codec`'s codecs), encoded once, at its first save, and decoded,
to the same dtype and strides, when backward reads it, both in pieces of at most :data:`PIECE` values (the float32
copy a codec makes is of one piece). The experts use it for what their gate/up projection keeps of its input and what
their SwiGLU keeps of its input (:mod:`~lightning_ciuic.parallel.experts.gemm`): the gradients that read those read
the decoded values, within the codec's rounding. Every other saved tensor goes to the saved-tensor hooks outside, as
it would without this context (a recomputation's, :mod:`~lightning_ciuic.parallel.recompute`). Nothing changes with
``codec=None``, without gradients, or where torch's checkpointing hooks are the innermost (a block recomputed whole
keeps nothing of its experts to encode; selective checkpointing decides what it keeps itself).

No Lightning imports.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Optional

import torch

from lightning_ciuic import compat
from lightning_ciuic.wire.codecs import Codec

PIECE = 1 << 24  # values encoded at once (a multiple of the fp8/int8 block, 128)


class _Encoded:
    """``rows`` as ``codec`` encodes them, in pieces of at most :data:`PIECE` values; :class:`_View` the saved view."""

    def __init__(self, pieces: list[torch.Tensor], codec: Codec, rows: torch.Tensor) -> None:
        self.pieces, self.codec, self.shape, self.dtype, self.device = pieces, codec, rows.shape, rows.dtype, rows.device

    def decoded(self, geometry: tuple) -> torch.Tensor:
        """The rows decoded (a piece at a time into one tensor of their dtype), as the saved view of them."""
        numel = self.shape.numel()
        rows = torch.empty(numel, dtype=self.dtype, device=self.device)
        for start, piece in zip(range(0, numel, PIECE), self.pieces):
            n = min(PIECE, numel - start)
            rows[start : start + n].copy_(self.codec.decode(piece, n))
        size, stride, offset = geometry
        return rows.view(self.shape).as_strided(size, stride, offset)


class _View:
    """A saved view of the encoded rows: its size, stride and offset in them."""

    def __init__(self, encoded: _Encoded, geometry: tuple) -> None:
        self.encoded, self.geometry = encoded, geometry


class _Outer:
    """What the hooks outside made of a saved tensor."""

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class kept_encoded:
    """Context: ``rows`` (and views of it) saved for backward as ``codec`` encodes them (see the module docstring)."""

    def __init__(self, rows: torch.Tensor, codec: Optional[Codec]) -> None:
        self.rows: Optional[torch.Tensor] = rows
        self.codec = codec
        self.encoded: Optional[_Encoded] = None
        self.outer: Optional[tuple] = None
        self._stack = ExitStack()

    def __enter__(self) -> "kept_encoded":
        outer = compat.saved_tensors_hooks_outside()
        if self.codec is None or not torch.is_grad_enabled() or compat.is_torch_checkpoint_hook(outer):
            return self
        self.outer = outer
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self.rows = None  # what autograd keeps holds the unpack hook, so this context: not the rows it encoded

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor is self.rows or compat.view_base(tensor) is self.rows:
            if self.encoded is None:
                flat = self.rows.detach().reshape(-1)
                pieces = [self.codec.encode(flat[i : i + PIECE].float()) for i in range(0, flat.numel(), PIECE)]
                self.encoded = _Encoded(pieces, self.codec, self.rows)
            return _View(self.encoded, (tensor.size(), tensor.stride(), tensor.storage_offset() - self.rows.storage_offset()))
        return _Outer(self.outer[0](tensor)) if self.outer is not None else tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _View):
            return packed.encoded.decoded(packed.geometry)
        return self.outer[1](packed.packed) if isinstance(packed, _Outer) else packed
