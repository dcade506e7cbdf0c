"""Snapshots of one rank's training state, kept where the fault being handled cannot reach them.

Contract:

* A snapshot is bytes: a header (step, loss, ... as JSON, the codec, the payload's size and CRC-32) and the state
  serialized by ``torch.save``, zstd-compressed or raw. :func:`decode_snapshot` re-checks size and CRC and raises
  :class:`CorruptSnapshotError` on any mismatch or truncation: a damaged snapshot (a torn write, a flipped bit) is
  never loaded. CRC-32 guards against accidents, not tampering; it runs at memory speed (BLAKE2b took 2x longer).
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
import os
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
import zstandard

StateCompression = Literal["zstd", "none"]
COMPRESSIONS = ("zstd", "none")
_MAGIC = b"CIUICSNP"
_HEADER_LEN = struct.Struct("<I")
_SUFFIX = ".snap"


class CorruptSnapshotError(RuntimeError):
    """A snapshot's bytes do not match the size and CRC written with them."""


def encode_snapshot(state: Any, meta: dict[str, Any], compression: StateCompression = "zstd") -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    if compression == "zstd":
        payload = zstandard.ZstdCompressor(level=1).compress(payload)
    header = dict(meta, compression=compression, size=len(payload), crc32=zlib.crc32(payload))
    encoded = json.dumps(header).encode()
    return b"".join([_MAGIC, _HEADER_LEN.pack(len(encoded)), encoded, payload])


def snapshot_header(blob: bytes, name: str = "snapshot") -> dict[str, Any]:
    """The header of an encoded snapshot (or of its first bytes), without reading the payload."""
    start = len(_MAGIC) + _HEADER_LEN.size
    if blob[: len(_MAGIC)] != _MAGIC or len(blob) < start:
        raise CorruptSnapshotError(f"{name}: not a snapshot (bad magic or cut short).")
    (length,) = _HEADER_LEN.unpack(blob[len(_MAGIC) : start])
    try:
        return json.loads(blob[start : start + length])
    except ValueError as error:
        raise CorruptSnapshotError(f"{name}: unreadable header ({error}).") from error


def decode_snapshot(blob: bytes, name: str = "snapshot") -> tuple[Any, dict[str, Any]]:
    header = snapshot_header(blob, name)
    (length,) = _HEADER_LEN.unpack(blob[len(_MAGIC) : len(_MAGIC) + _HEADER_LEN.size])
    payload = blob[len(_MAGIC) + _HEADER_LEN.size + length :]
    if len(payload) != header["size"] or zlib.crc32(payload) != header["crc32"]:
        raise CorruptSnapshotError(
            f"{name}: payload of {len(payload)} bytes does not match its CRC-32 (expected {header['size']} bytes)."
        )
    if header["compression"] == "zstd":
        payload = zstandard.ZstdDecompressor().decompress(payload)
    return torch.load(io.BytesIO(payload), weights_only=False), header


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
        self._blobs: dict[int, bytes] = {}

    def put(self, step: int, blob: bytes) -> None:
        self._blobs[step] = blob

    def headers(self) -> dict[int, dict[str, Any]]:
        """Step -> header of every snapshot whose header reads (a damaged one is left out)."""
        found = {}
        for step, blob in self._blobs.items():
            try:
                found[step] = snapshot_header(blob)
            except CorruptSnapshotError:
                continue
        return found

    def get(self, step: int) -> bytes:
        return self._blobs[step]

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

    def put(self, step: int, blob: bytes) -> None:
        temporary = self.directory / f".{step}.{os.getpid()}.tmp"
        temporary.write_bytes(blob)
        os.replace(temporary, self._path(step))

    def headers(self) -> dict[int, dict[str, Any]]:
        found = {}
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            try:
                with open(path, "rb") as file:
                    found[int(path.stem)] = snapshot_header(file.read(64 * 1024), str(path))
            except (CorruptSnapshotError, OSError, ValueError):
                continue
        return found

    def get(self, step: int) -> bytes:
        try:
            return self._path(step).read_bytes()
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
