"""The snapshot format: one rank's training state as checksummed bytes.

Contract: a snapshot is a 4 KB header (step, loss, ... as JSON, the codec, the payload's size, and its CRC-32 when
raw; a zstd frame carries its own xxHash64 content checksum) and the payload, zstd-compressed or raw: the state's
structure pickled, then every tensor's bytes (64-byte aligned). :func:`write_snapshot` streams tensors straight
from their memory into the file (no intermediate copy); :func:`decode_snapshot` re-checks size and checksum,
raising :class:`CorruptSnapshotError` on any mismatch or truncation (a damaged snapshot, a torn write or a flipped
bit, is never loaded), and returns tensors that are views of the snapshot's buffer. The checksums guard against
accidents, not tampering; they run at memory speed. No Lightning imports.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import zlib
from typing import Any, BinaryIO, Literal

import torch
import zstandard

StateCompression = Literal["zstd", "none"]
COMPRESSIONS = ("zstd", "none")
_MAGIC = b"CIUICSN2"
_HEADER_BYTES = 4096  # magic + JSON header, space-padded: rewritten in place once the payload is known
_ALIGN = 64
_SKELETON_LEN = struct.Struct("<Q")


class CorruptSnapshotError(RuntimeError):
    """A snapshot's bytes do not match the size and CRC written with them."""


class _TensorPickler(pickle.Pickler):
    """Pickles the state's structure; tensors become references to byte ranges that follow it."""

    def __init__(self, file: BinaryIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.offset = tensors, 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        tensor = obj.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        reference = ("tensor", self.offset, nbytes, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        self.tensors.append(tensor)
        self.offset += -(-nbytes // _ALIGN) * _ALIGN
        return reference


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, data: memoryview) -> None:
        super().__init__(file)
        self.data = data

    def persistent_load(self, reference: Any) -> torch.Tensor:
        _, offset, nbytes, dtype, shape = reference
        if nbytes == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        flat = torch.frombuffer(self.data, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat.view(getattr(torch, dtype)).reshape(shape)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def write_snapshot(state: Any, meta: dict[str, Any], compression: StateCompression, sink: BinaryIO) -> dict[str, Any]:
    """Stream a snapshot into a seekable ``sink`` (a file, a BytesIO) without copying the state's tensors into an
    intermediate buffer; returns its header."""
    tensors: list[torch.Tensor] = []
    skeleton = io.BytesIO()
    _TensorPickler(skeleton, tensors).dump(state)
    start = sink.tell()
    sink.write(b" " * _HEADER_BYTES)
    crc, size, raw_size = 0, 0, 0
    # zstd frames carry their own content checksum (xxHash64, checked while decompressing): no CRC pass then.
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj() if compression == "zstd" else None

    def emit(piece: bytes | memoryview) -> None:
        nonlocal crc, size, raw_size
        raw_size += len(piece)
        out = compressor.compress(piece) if compressor is not None else piece
        if out:
            if compressor is None:
                crc = zlib.crc32(out, crc)
            size += len(out)
            sink.write(out)

    skeleton_bytes = skeleton.getbuffer()
    emit(_SKELETON_LEN.pack(len(skeleton_bytes)))
    emit(skeleton_bytes)
    emit(b"\0" * (-(len(skeleton_bytes) + _SKELETON_LEN.size) % _ALIGN))
    for tensor in tensors:
        data = _tensor_bytes(tensor)
        emit(data)
        emit(b"\0" * (-len(data) % _ALIGN))
    if compressor is not None:
        tail = compressor.flush()
        size += len(tail)
        sink.write(tail)
    header = dict(meta, compression=compression, size=size, raw_size=raw_size, crc32=crc if compressor is None else None)
    encoded = _MAGIC + json.dumps(header).encode()
    if len(encoded) > _HEADER_BYTES:
        raise ValueError(f"snapshot metadata too large ({len(encoded)} bytes > {_HEADER_BYTES}): {meta}")
    end = sink.tell()
    sink.seek(start)
    sink.write(encoded)
    sink.seek(end)
    return header


def encode_snapshot(state: Any, meta: dict[str, Any], compression: StateCompression = "zstd") -> memoryview:
    """A snapshot as bytes in memory (see :func:`write_snapshot`)."""
    buffer = io.BytesIO()
    write_snapshot(state, meta, compression, buffer)
    return buffer.getbuffer()


def snapshot_header(blob: bytes | memoryview, name: str = "snapshot") -> dict[str, Any]:
    """The header of an encoded snapshot (or of its first 4 KB), without reading the payload."""
    if bytes(blob[: len(_MAGIC)]) != _MAGIC or len(blob) < _HEADER_BYTES:
        raise CorruptSnapshotError(f"{name}: not a snapshot (bad magic or cut short).")
    try:
        return json.loads(bytes(blob[len(_MAGIC) : _HEADER_BYTES]))
    except ValueError as error:
        raise CorruptSnapshotError(f"{name}: unreadable header ({error}).") from error


def decode_snapshot(blob: bytes | bytearray | memoryview, name: str = "snapshot") -> tuple[Any, dict[str, Any]]:
    """The state and header of a snapshot. Tensors are views of ``blob`` (uncompressed) or of one decompressed
    buffer: pass a writable buffer the caller does not reuse."""
    header = snapshot_header(blob, name)
    payload = memoryview(blob)[_HEADER_BYTES:]
    damaged = f"{name}: payload of {len(payload)} bytes (expected {header['size']}) does not match its checksum"
    if len(payload) != header["size"] or (header["crc32"] is not None and zlib.crc32(payload) != header["crc32"]):
        raise CorruptSnapshotError(damaged + " (CRC-32).")
    if header["compression"] == "zstd":
        raw = bytearray(header["raw_size"])
        try:
            with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
                filled = reader.readinto(raw)
                while filled < len(raw):
                    more = reader.readinto(memoryview(raw)[filled:])
                    if not more:
                        break
                    filled += more
                trailing = reader.read(1)
        except zstandard.ZstdError as error:
            raise CorruptSnapshotError(f"{damaged} (zstd: {error}).") from error
        if filled != len(raw) or trailing:
            raise CorruptSnapshotError(f"{damaged} (zstd: {filled} bytes decompressed, expected {len(raw)}).")
        payload = memoryview(raw)
    (length,) = _SKELETON_LEN.unpack(payload[: _SKELETON_LEN.size])
    skeleton_end = _SKELETON_LEN.size + length
    data = payload[skeleton_end + (-skeleton_end % _ALIGN) :]
    if data.readonly:
        data = memoryview(bytearray(data))
    state = _TensorUnpickler(io.BytesIO(payload[_SKELETON_LEN.size : skeleton_end]), data).load()
    return state, header
