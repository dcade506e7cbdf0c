"""Gradient codecs: fp16 / bf16 casts, block-wise int8 and nf4 quantizers, top-k sparsification, and
the error-feedback memory that makes lossy codecs converge.

Contract of a dense :class:`Codec`: ``encode(x)`` turns a flat float32 tensor into a ``uint8`` tensor of
exactly ``nbytes(x.numel())`` bytes, ``decode(data, numel)`` returns float32 again. Inputs whose length is
not a multiple of ``block`` are zero-padded internally. The collectives use the allocation-free forms:
``encode_into(x, out, numel)`` encodes ``x`` as if zero-padded to ``numel`` values into ``out``
(``nbytes(numel)`` bytes), ``decode_into(data, numel, out, accumulate)`` writes (or adds) the first
``out.numel()`` of the ``numel`` values ``data`` encodes into ``out``. ``BlockInt8`` and ``NF4`` (one base,
``_BlockScaled``) implement both in slices of :data:`CPU_SLICE` values on the CPU, so each slice's passes
(absmax, scale, quantize, store) run in cache and no bucket-sized temporary is made; on other devices, and on fake
tensors (the planner's step: no data to keep in cache, and each slice's ops would cost a fake dispatch each), in one
piece. Stated error bounds (tested):

* ``fp16``: relative error <= 2**-11 for normal-range values; ``bf16``: <= 2**-8.
* ``int8``: per block of 256 values, absolute error <= absmax(block) / 254 (half a quantization step);
  wire size 1 + 4/256 bytes per value (25.4% of fp32).
* ``nf4``: the 16 NormalFloat levels of QLoRA (Dettmers et al., 2023) scaled by each block's absmax, blocks
  of 64; absolute error <= 0.152 * absmax(block) (half the widest gap between levels); wire size
  0.5 + 4/64 bytes per value (14.1% of fp32).
* ``fp8`` (:class:`BlockFP8`, for activations: the expert dispatch): e4m3 codes scaled by each block's absmax / 448,
  relative error <= 2**-4 per value in e4m3's normal range; 1 + 4/128 bytes per value with blocks of 128.

:class:`TopK` keeps the ``ratio`` largest-magnitude values with their indices (8 bytes per kept value).
:class:`ErrorFeedback` keeps, per buffer, what compression dropped and adds it back next time (Seide et
al., 2014; Karimireddy et al., 2019), so the running sum of decoded values tracks the true sum.

No Lightning imports.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Literal

import torch

from lightning_ciuic import compat
from lightning_ciuic.validation import check_int

DenseCodecName = Literal["none", "fp16", "bf16", "int8", "nf4"]
CPU_SLICE = 1 << 16  # values per pass on the CPU: 256 KB of float32 stays in L2 while a slice is worked on

NF4_LEVELS = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ]
)
_NF4_MIDPOINT_VALUES = ((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2).tolist()  # float32 values, exactly
_BYTES = torch.arange(256, device="cpu")  # a host table, like NF4_LEVELS: moved to the codes' device where used
_NF4_BYTE_LEVELS = torch.stack([NF4_LEVELS[_BYTES >> 4], NF4_LEVELS[_BYTES & 0x0F]], dim=1)  # byte -> its 2 levels


class Codec(ABC):
    """A dense codec: fixed wire size for a given number of values, so chunks can be exchanged blindly."""

    name: str = "codec"
    block: int = 1

    @abstractmethod
    def nbytes(self, numel: int) -> int: ...

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor: ...

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.numel())

    def encode_into(self, x: torch.Tensor, out: torch.Tensor, numel: int) -> None:
        """Encode ``x`` zero-padded to ``numel`` values into ``out`` (``nbytes(numel)`` bytes)."""
        if x.numel() < numel:
            x = torch.cat([x.reshape(-1), x.new_zeros(numel - x.numel())])
        out.copy_(self.encode(x))

    def decode_into(self, data: torch.Tensor, numel: int, out: torch.Tensor, accumulate: bool = False) -> None:
        """Write (``accumulate``: add) the first ``out.numel()`` of the ``numel`` values ``data`` encodes into ``out``."""
        decoded = self.decode(data, numel)[: out.numel()]
        out.add_(decoded) if accumulate else out.copy_(decoded)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FullPrecision(Codec):
    """``dtype`` on the wire (float32 by default; a float64 bucket's own dtype keeps it exact): no compression, the
    reference the others are measured against."""

    name = "none"

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def nbytes(self, numel: int) -> int:
        return self.dtype.itemsize * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        return data.view(self.dtype)[:numel]


class HalfPrecision(Codec):
    """Cast to a 16-bit float on the wire."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"HalfPrecision takes torch.float16 or torch.bfloat16, got {dtype}.")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        return data.view(self.dtype)[:numel].float()

    def __repr__(self) -> str:
        return f"HalfPrecision({self.dtype})"


class _BlockScaled(Codec):
    """Per-block codecs laid out as every block's float32 scale, then every block's codes (``code_bytes`` per
    block). ``encode_into`` / ``decode_into`` work in slices of :data:`CPU_SLICE` values on the CPU (one piece on
    other devices): each slice is read once, quantized in cache and written straight into the output. Subclasses
    say how one slice's blocks become a scale per block and codes (``_quantize``) and back (``_dequantize``)."""

    block: int
    code_bytes: int

    def nbytes(self, numel: int) -> int:
        blocks = math.ceil(numel / self.block)
        return 4 * blocks + blocks * self.code_bytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        self.encode_into(x.reshape(-1), out, x.numel())
        return out

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=data.device)
        self.decode_into(data, numel, out)
        return out

    def _slices(self, data: torch.Tensor, numel: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(first value, last value, scales, codes) of each slice of an encoding of ``numel`` values."""
        blocks = math.ceil(numel / self.block)
        scales, codes = data[: 4 * blocks].view(torch.float32), data[4 * blocks :].view(blocks, self.code_bytes)
        rows = max(1, CPU_SLICE // self.block) if data.device.type == "cpu" and not compat.is_fake(data) else blocks
        for first in range(0, blocks, rows):
            last = min(first + rows, blocks)
            yield first * self.block, last * self.block, scales[first:last], codes[first:last]

    def encode_into(self, x: torch.Tensor, out: torch.Tensor, numel: int) -> None:
        for start, end, scales, codes in self._slices(out, numel):
            values = x[start:end].float()
            if values.numel() < end - start:  # the end of x (or past it): zeros
                values = torch.cat([values, values.new_zeros(end - start - values.numel())])
            scales.copy_(self._quantize(values.view(-1, self.block), codes))

    def decode_into(self, data: torch.Tensor, numel: int, out: torch.Tensor, accumulate: bool = False) -> None:
        flat = out.reshape(-1)
        for start, end, scales, codes in self._slices(data, numel):
            target = flat[start:end]
            if target.numel() == 0:
                break
            values = self._dequantize(codes, scales).view(-1)[: target.numel()]
            target.add_(values) if accumulate else target.copy_(values)

    @abstractmethod
    def _quantize(self, blocks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Write the codes of ``blocks`` (rows of ``block`` values) into ``codes``; return each block's scale."""

    @abstractmethod
    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The values (rows of ``block``) that ``codes`` and ``scales`` encode."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"


class _AbsmaxScaled(_BlockScaled):
    """One byte per value: ``code = x / scale`` in ``code_dtype``, ``scale = absmax / largest`` (the code's largest
    magnitude), so no value needs clamping; an all-zero block has scale 0 and decodes to zeros."""

    code_dtype: torch.dtype
    largest: float

    def __init__(self, block: int) -> None:
        check_int("block", block)
        self.block = self.code_bytes = block

    def _quantize(self, blocks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        scale = torch.amax(blocks.abs(), dim=1).div_(self.largest)
        inverse = scale.reciprocal().nan_to_num_(posinf=0.0)
        codes.view(self.code_dtype).copy_(self._to_code(blocks.mul(inverse[:, None])))
        return scale

    def _to_code(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return codes.view(self.code_dtype).float().mul_(scales[:, None])


class BlockInt8(_AbsmaxScaled):
    """Symmetric int8 per block: ``q = round(x / scale)``, ``scale = absmax / 127``."""

    name, code_dtype, largest = "int8", torch.int8, 127.0

    def __init__(self, block: int = 256) -> None:
        super().__init__(block)

    def _to_code(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_()


class BlockFP8(_AbsmaxScaled):
    """FP8 (e4m3) per block: ``q = fp8(x / scale)``, ``scale = absmax / 448`` (e4m3's largest value): relative error
    <= 2**-4 of each value above the block's smallest normal, as DeepSeek-V3 quantizes activations in 1x128 tiles."""

    name, code_dtype, largest = "fp8", torch.float8_e4m3fn, 448.0

    def __init__(self, block: int = 128) -> None:
        super().__init__(block)


class NF4(_BlockScaled):
    """4-bit NormalFloat per block: each value becomes the nearest of 16 levels times the block's absmax; two
    codes per byte (the first in the high nibble)."""

    name = "nf4"

    def __init__(self, block: int = 64) -> None:
        if block < 2 or block % 2:
            raise ValueError(f"block must be an even number >= 2, got {block}.")
        self.block, self.code_bytes = block, block // 2

    def _quantize(self, blocks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        scale = blocks.abs().amax(dim=1)
        normalized = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        levels = torch.zeros(normalized.shape, dtype=torch.uint8, device=normalized.device)
        for midpoint in _NF4_MIDPOINT_VALUES:  # the nearest level's index: how many midpoints lie below the value
            levels.add_(normalized > midpoint)
        torch.bitwise_or(levels[:, 0::2] << 4, levels[:, 1::2], out=codes)
        return scale

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        pairs = torch.index_select(_NF4_BYTE_LEVELS.to(codes.device), 0, codes.reshape(-1).to(torch.int32))
        return pairs.view(codes.shape[0], self.block).mul_(scales[:, None])


def dense_codec(name: str) -> Codec:
    """The dense codec for a mode name (``none``, ``fp16``, ``bf16``, ``int8``, ``nf4``)."""
    codecs = {
        "none": FullPrecision,
        "fp16": lambda: HalfPrecision(torch.float16),
        "bf16": lambda: HalfPrecision(torch.bfloat16),
        "int8": BlockInt8,
        "nf4": NF4,
    }
    if name not in codecs:
        raise ValueError(f"no dense codec named {name!r}; use one of {sorted(codecs)}.")
    return codecs[name]()


class TopK:
    """Keep the ``ratio`` fraction of largest-magnitude values: (int32 index, float32 value) pairs."""

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"compression_ratio must be in (0, 1], got {ratio!r} (0.01 keeps the top 1%).")
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.ratio * numel)))

    def nbytes(self, numel: int) -> int:
        return 8 * self.k(numel)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1)
        indices = flat.abs().topk(self.k(flat.numel()), sorted=False).indices
        return indices.to(torch.int32), flat[indices].float()

    @staticmethod
    def decode(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
        out = values.new_zeros(numel)
        return out.index_add_(0, indices.long(), values)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(*self.encode(x), x.numel())

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio})"


class ErrorFeedback:
    """Per-buffer residual memory, in place: ``compensate_(key, x)`` adds the stored residual to ``x`` and keeps
    the result (the compensated value) in the residual's slot; ``settle(key, transmitted)`` subtracts what the
    codec delivered, leaving what it dropped for next time. No buffer-sized temporary after the first call."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate_(self, key: str, x: torch.Tensor) -> None:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != x.shape:
            self.residuals[key] = x.detach().clone()
            return
        if residual.device != x.device:  # restored from a checkpoint on the CPU: to the gradients' device, once
            residual = self.residuals[key] = residual.to(x.device)
        x.add_(residual)
        residual.copy_(x)

    def settle(self, key: str, transmitted: torch.Tensor) -> None:
        self.residuals[key].sub_(transmitted.view_as(self.residuals[key]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}
