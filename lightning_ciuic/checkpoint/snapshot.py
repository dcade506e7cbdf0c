"""Snapshots of one rank's training state, kept where the fault being handled cannot reach them.

Contract:

* A snapshot is bytes: a 4 KB header (step, loss, ... as JSON, the codec, the payload's size, and its CRC-32 when
  raw; a zstd frame carries its own xxHash64 content checksum) and the payload, zstd-compressed or raw: the state's structure pickled, then every tensor's bytes (64-byte aligned).
  :func:`write_snapshot` streams tensors straight from their memory into the file (no intermediate copy);
  :func:`decode_snapshot` re-checks size and checksum, raising :class:`CorruptSnapshotError` on any mismatch or
  truncation (a damaged snapshot, a torn write or a flipped bit, is never loaded), and returns tensors that are
  views of the snapshot's buffer. The checksums guard against accidents, not tampering; they run at memory speed.
* Stores keep snapshots by step:

  - :class:`MemoryStore`: this process's memory. Survives what the process survives (an in-process rollback).
  - :class:`ShmStore`: files in a directory on shared memory (``/dev/shm``), written under a temporary name and
    renamed, so a process killed while writing leaves no half snapshot under a real name. Survives the process:
    a restarted worker on the same node finds it.

* :func:`claim_run_directory` makes the run's directory and starts, once per node, a reaper (a detached shell
  loop, no Python) that deletes it when the owner process exits: the TorchElastic agent, which outlives every
  restart, or the launching process. Shared memory is released after the run however it ends, ``kill -9``
  included; :meth:`ShmStore.clear` releases it at once after a clean finish.
* Peers: :func:`peer_of` pairs each rank with one on another node (the next node's rank with the same local
  rank; on a single node, the next rank). :func:`exchange` sends this rank's snapshot to its peer and receives
  the snapshot of the rank it is peer to, so a copy of every rank's state lives in another node's memory and
  survives losing a node. :func:`transfer` moves one snapshot from its holder to the rank that lost it.

No Lightning imports.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import pickle
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, Optional

import torch
import torch.distributed as dist
import zstandard

StateCompression = Literal["zstd", "none"]
COMPRESSIONS = ("zstd", "none")
_MAGIC = b"CIUICSN2"
_HEADER_BYTES = 4096  # magic + JSON header, space-padded: rewritten in place once the payload is known
_ALIGN = 64
_SKELETON_LEN = struct.Struct("<Q")
_SUFFIX = ".snap"


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


def recovery_order(losses: dict[int, Optional[float]], strategy: str) -> list[int]:
    """Steps to try, best first: ``"latest"``: newest first; ``"min_loss"``: lowest recorded loss first (a
    snapshot without a finite loss last), newest first among equal losses."""
    if strategy == "latest":
        return sorted(losses, reverse=True)

    def rank(step: int) -> tuple[float, int]:
        loss = losses[step]
        return (loss if loss is not None and math.isfinite(loss) else math.inf, -step)

    return sorted(losses, key=rank)


class MemoryStore:
    """Snapshots in this process's memory."""

    kind = "memory"

    def __init__(self) -> None:
        self._blobs: dict[int, memoryview] = {}

    def save(self, step: int, state: Any, meta: dict[str, Any], compression: StateCompression) -> None:
        self.put(step, encode_snapshot(state, meta, compression))

    def put(self, step: int, blob: bytes | memoryview) -> None:
        self._blobs[step] = memoryview(blob)

    def headers(self) -> dict[int, dict[str, Any]]:
        """Step -> header of every snapshot whose header reads (a damaged one is left out)."""
        found = {}
        for step, blob in self._blobs.items():
            try:
                found[step] = snapshot_header(blob)
            except CorruptSnapshotError:
                continue
        return found

    def get(self, step: int) -> bytearray:
        """A private, writable copy of the snapshot's bytes (decoded tensors are views of it)."""
        return bytearray(self._blobs[step])

    def drop(self, step: int) -> None:
        self._blobs.pop(step, None)

    def clear(self) -> None:
        self._blobs.clear()


class ShmStore(MemoryStore):
    """Snapshots as ``<step>.snap`` files in ``directory`` (on shared memory)."""

    kind = "shm"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, step: int) -> Path:
        return self.directory / f"{step:012d}{_SUFFIX}"

    def _temporary(self, step: int) -> Path:
        return self.directory / f".{step}.{os.getpid()}.tmp"

    def save(self, step: int, state: Any, meta: dict[str, Any], compression: StateCompression) -> None:
        temporary = self._temporary(step)
        with open(temporary, "wb") as file:
            write_snapshot(state, meta, compression, file)
        os.replace(temporary, self._path(step))

    def put(self, step: int, blob: bytes | memoryview) -> None:
        temporary = self._temporary(step)
        temporary.write_bytes(blob)
        os.replace(temporary, self._path(step))

    def headers(self) -> dict[int, dict[str, Any]]:
        found = {}
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            try:
                with open(path, "rb") as file:
                    found[int(path.stem)] = snapshot_header(file.read(_HEADER_BYTES), str(path))
            except (CorruptSnapshotError, OSError, ValueError):
                continue
        return found

    def get(self, step: int) -> memoryview:
        """The file mapped copy-on-write: no read copy (its pages are already in memory), and writes to decoded
        tensors stay private to this process."""
        try:
            with open(self._path(step), "rb") as file:
                if os.fstat(file.fileno()).st_size == 0:
                    return memoryview(bytearray())
                return memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY))
        except FileNotFoundError as error:
            raise KeyError(step) from error

    def drop(self, step: int) -> None:
        self._path(step).unlink(missing_ok=True)

    def clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def claim_run_directory(directory: str | os.PathLike, owner_pid: int) -> Path:
    """Create ``directory`` and, unless this node already has one for it, a reaper that deletes it once
    ``owner_pid`` has exited. Safe to call from every local rank and again after a restart."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        marker = os.open(directory / "reaper", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return directory
    script = 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; rm -rf "$2"'
    reaper = subprocess.Popen(
        ["sh", "-c", script, "lightning-ciuic-snapshot-reaper", str(owner_pid), str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the worker's process group: a kill of the workers spares it
    )
    os.write(marker, str(reaper.pid).encode())
    os.close(marker)
    return directory


def peer_of(rank: int, world_size: int, local_world_size: int) -> int:
    """The rank that keeps a copy of ``rank``'s snapshots: the same local rank on the next node, or the next
    rank when there is one node (which then survives losing a process, not losing the node)."""
    shift = local_world_size if world_size > local_world_size else 1
    return (rank + shift) % world_size


def _send_bytes(blob: bytes, dst: int, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Start sending ``blob`` (its length, then its bytes); wait on the returned requests."""
    requests = [dist.isend(torch.tensor([len(blob)], dtype=torch.int64), dst, group=group)]
    if blob:
        requests.append(dist.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group))
    return requests


def _recv_bytes(src: int, group: Optional[dist.ProcessGroup]) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.recv(data, src, group=group)
    return data.numpy().tobytes()


def exchange(blob: bytes, rank: int, world_size: int, local_world_size: int, group: Optional[dist.ProcessGroup] = None) -> bytes:
    """Collective over ``group`` (global ranks): send ``blob`` to :func:`peer_of` this rank and return the blob of
    the rank this one is peer to."""
    peer = peer_of(rank, world_size, local_world_size)
    source = next(r for r in range(world_size) if peer_of(r, world_size, local_world_size) == rank)
    requests = _send_bytes(blob, peer, group)
    received = _recv_bytes(source, group)
    for request in requests:
        request.wait()
    return received


@dataclass(frozen=True)
class Holding:
    """A snapshot a process holds: where (its own store or its peer replicas), and whose state it is."""

    holder: int  # the process (global rank now) that has it
    where: str  # "own" or "replica"
    step: int
    world_size: int  # of the run that took it
    rank: int  # the rank whose state it is, in that run
    pp: int = 1
    tp: int = 1
    loss: Optional[float] = None


@dataclass(frozen=True)
class RestorePlan:
    """Where each rank of the current run gets its state from, for one snapshot step."""

    step: int
    world_size: int  # of the run that took the snapshot
    sources: tuple[Holding, ...]  # indexed by the current rank

    @property
    def resharded(self) -> bool:
        """The state comes from another layout or another rank (a data-parallel replica): rank-local state such
        as compression residuals does not apply."""
        return any(source.rank != rank or source.world_size != len(self.sources) for rank, source in enumerate(self.sources))


def plan_restores(holdings: Iterable[Holding], world_size: int, pp: int = 1, tp: int = 1) -> list[RestorePlan]:
    """Every snapshot step the current run (``world_size`` ranks, ``pp`` x dp x ``tp``) can restore, newest first.

    A rank restores its own state from the same layout, or, when only the data-parallel size changed (``pp == 1``
    and ``tp`` kept), the state of any rank with its tensor-parallel coordinate: data-parallel replicas hold the
    same model and optimizer state. A holding on the rank itself is preferred to one another process must send.
    """
    by_step: dict[tuple[int, int], list[Holding]] = {}
    for holding in holdings:
        by_step.setdefault((holding.step, holding.world_size), []).append(holding)
    plans = []
    for (step, world), found in by_step.items():
        same_layout = world == world_size and all(h.pp == pp and h.tp == tp for h in found)
        reshardable = pp == 1 and all(h.pp == 1 and h.tp == tp for h in found)
        sources = []
        for rank in range(world_size):
            if same_layout:
                fits = [h for h in found if h.rank == rank]
            elif reshardable:
                fits = [h for h in found if h.rank % tp == rank % tp]
            else:
                fits = []
            if not fits:
                break
            sources.append(min(fits, key=lambda h: (h.holder != rank, h.where != "own", h.holder, h.rank)))
        else:
            plans.append(RestorePlan(step, world, tuple(sources)))
    return sorted(plans, key=lambda plan: (plan.step, plan.world_size == world_size), reverse=True)


def transfer(moves: Iterable[tuple[int, int]], rank: int, blob_for: Any, group: Optional[dist.ProcessGroup] = None) -> dict[int, bytes]:
    """Collective: for each ``(holder, owner)`` in the same order on every rank, ``holder`` sends
    ``blob_for(owner)`` to ``owner``. Returns the blobs this rank received, by owner."""
    received = {}
    for holder, owner in moves:
        if rank == holder:
            for request in _send_bytes(blob_for(owner), owner, group):
                request.wait()
        elif rank == owner:
            received[owner] = _recv_bytes(holder, group)
    return received
