"""Where snapshots are kept, by step, out of the reach of the fault being handled.

Contract:

- :class:`MemoryStore`: this process's memory. Survives what the process survives (an in-process rollback).
- :class:`ShmStore`: files in a directory on shared memory (``/dev/shm``), written under a temporary name and
  renamed, so a process killed while writing leaves no half snapshot under a real name. Survives the process: a
  restarted worker on the same node finds it.
- :func:`claim_run_directory` makes the run's directory and starts, once per node, a reaper (a detached shell
  loop, no Python) that deletes it when the owner process exits: the TorchElastic agent, which outlives every
  restart, or the launching process. Shared memory is released after the run however it ends, ``kill -9``
  included; :meth:`ShmStore.clear` releases it at once after a clean finish.

No Lightning imports.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from lightning_ciuic.checkpoint.snapshot.format import (
    _HEADER_BYTES,
    CorruptSnapshotError,
    StateCompression,
    encode_snapshot,
    snapshot_header,
    write_snapshot,
)

_SUFFIX = ".snap"


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
