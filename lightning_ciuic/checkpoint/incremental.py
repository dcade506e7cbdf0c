"""Content-addressed chunks and checkpoint manifests: incremental saves, verification, retention.

Layout under a :class:`~lightning_ciuic.checkpoint.storage.Storage` root::

    chunks/<h[:2]>/<h>.zst        zstd-compressed bytes whose digest (of the raw bytes) is <h>
    chunks/<h[:2]>/<h>.raw        the same, stored raw (compression off, or zstd would not shrink them by 15%)
    checkpoints/<name>/metadata   the DCP metadata (pickled), with every item's list of chunks
    checkpoints/<name>/manifest.json   the commit record, written last
    latest                        the name of the newest commit (what ``"last"`` points at)

Digests (the manifest's ``format``): format 2 (written now) names chunks and checks the metadata by BLAKE3-256
(64 hex digits; several times BLAKE2b's throughput on one core, ``benchmarks/hashing.py``: hashing is most of a
save's CPU work); format 1 (BLAKE2b-128, 32 hex digits) is still read and verified. A digest's length says which
function made it.

Contract:

* :meth:`ChunkStore.put` stores bytes as chunks of at most ``chunk_bytes``; a chunk whose digest is already
  stored is referenced, not rewritten (incremental: unchanged tensors cost a hash, not a write), unless the
  store is made with ``incremental=False``.
* :meth:`ChunkStore.get` reads, decompresses and re-hashes; any mismatch or truncation raises
  :class:`CorruptCheckpointError` naming the file. :meth:`ChunkStore.read_into` does the same straight into a
  tensor's memory (no concatenation, no second copy).
* A checkpoint exists once ``manifest.json`` does (written atomically, after every chunk and the metadata);
  a crash at any moment before leaves the earlier checkpoints untouched and loadable.
* :meth:`CheckpointCatalog.retain` deletes the oldest checkpoints beyond ``max_keep`` (manifest first, so a
  half-deleted checkpoint is never listed) and then exactly the chunks no remaining manifest references;
  :meth:`CheckpointCatalog.sweep_orphans` removes chunks of saves that never committed (call it when no
  save is in flight).

No Lightning imports.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import blake3
import torch
import zstandard

from lightning_ciuic.checkpoint.storage import Storage

CHUNK_BYTES = 16 * 2**20
ZSTD_MIN_SAVING = 0.15  # compress a chunk only if zstd shrinks a sample of it by this much: fp32 state (7%) stays raw
MANIFEST = "manifest.json"
METADATA = "metadata"
LATEST = "latest"  # a pointer file rewritten at every commit: what "last" resolves to


class CorruptCheckpointError(RuntimeError):
    """Stored bytes do not match their checksum (truncated, corrupted or missing file)."""


class SaveAbandoned(RuntimeError):
    """A save stopped between chunks because :attr:`ChunkStore.abandon` was set; it never commits."""


FORMAT = 2  # what this version writes; 1: BLAKE2b-128 digests (read and verified still)


def digest(data: bytes | memoryview) -> str:
    """The BLAKE3-256 digest that names ``data`` (format 2)."""
    return blake3.blake3(data).hexdigest()


def matches(data: bytes | memoryview, name: str) -> bool:
    """Whether ``data`` has the digest ``name``: BLAKE3-256 (64 hex digits) or, from format 1, BLAKE2b-128 (32)."""
    if len(name) == 32:
        return hashlib.blake2b(data, digest_size=16).hexdigest() == name
    return digest(data) == name


class ChunkStore:
    def __init__(
        self,
        storage: Storage,
        compression: Optional[str] = "zstd",
        level: int = 3,
        chunk_bytes: int = CHUNK_BYTES,
        incremental: bool = True,
    ) -> None:
        if compression not in ("zstd", None):
            raise ValueError(f"compression={compression!r}; use 'zstd' or None.")
        if not 1 <= level <= 22:
            raise ValueError(f"compression_level={level} is outside zstd's 1..22.")
        self.storage, self.compression, self.level, self.chunk_bytes = storage, compression, level, chunk_bytes
        self.incremental = incremental  # False: every chunk is written again, even if stored
        self.written_bytes = 0  # stored bytes actually written by this process (after compression)
        self._known: dict[str, str] = {}  # digest -> chunk id, for chunks this process saw stored
        self.abandon = threading.Event()  # set: saves in progress stop before their next chunk (put)

    def __getstate__(self) -> dict[str, Any]:  # pickled into spawned ranks: a fresh event there
        return {k: v for k, v in self.__dict__.items() if k != "abandon"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, abandon=threading.Event())

    @staticmethod
    def _file(chunk: str) -> str:
        return f"chunks/{chunk[:2]}/{chunk}"

    def _encode(self, piece: memoryview) -> tuple[str, bytes | memoryview]:
        """``("zst", compressed)`` where zstd pays (a 64 kB sample shrinks by ``ZSTD_MIN_SAVING`` or more), else
        ``("raw", piece)``: fp32 weights and optimizer moments shrink by only about 7% (1.08x), for more CPU than
        hashing them; metadata, integers and zeros shrink far more. A raw piece is written from the
        caller's buffer, not copied (a copy costs as much CPU as hashing it)."""
        if self.compression == "zstd":
            compressor = zstandard.ZstdCompressor(level=self.level)
            sample = piece[: 64 * 1024]
            if len(compressor.compress(sample)) <= (1 - ZSTD_MIN_SAVING) * len(sample):
                return "zst", compressor.compress(piece)
        return "raw", piece

    def put(self, data: bytes | memoryview) -> list[str]:
        """Store ``data``; returns its chunk ids (``<digest>.zst`` or ``<digest>.raw``) in order. Raises
        :class:`SaveAbandoned` before the next chunk once :attr:`abandon` is set."""
        view = memoryview(data).cast("B")
        chunks = []
        for start in range(0, max(len(view), 1), self.chunk_bytes):
            if self.abandon.is_set():
                raise SaveAbandoned(f"save under {self.storage.url!r} abandoned (the run failed); it will not commit")
            piece = view[start : start + self.chunk_bytes]
            name = digest(piece)
            chunk = None
            if self.incremental:
                chunk = self._known.get(name) or next(
                    (f"{name}.{s}" for s in ("zst", "raw") if self.storage.exists(self._file(f"{name}.{s}"))), None
                )
            if chunk is None:
                suffix, stored = self._encode(piece)
                chunk = f"{name}.{suffix}"
                self.storage.write_atomic(self._file(chunk), stored)
                self.written_bytes += len(stored)
            self._known[name] = chunk
            chunks.append(chunk)
        return chunks

    def get(self, chunks: list[str]) -> bytes:
        """The concatenated, verified contents of ``chunks``."""
        return b"".join(self._verified(chunk) for chunk in chunks)

    def read_into(self, chunks: list[str], out: torch.Tensor) -> None:
        """Verify ``chunks`` and write their concatenated contents straight into the CPU tensor ``out`` (contiguous,
        exactly as many bytes): a restore without intermediate copies."""
        target = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        position = 0
        for chunk in chunks:
            raw = self._verified(chunk)
            if position + len(raw) > len(target):
                raise CorruptCheckpointError(f"chunk {self.storage.path(self._file(chunk))} overruns its tensor ({len(target)} bytes)")
            target[position : position + len(raw)] = raw
            position += len(raw)
        if position != len(target):
            raise CorruptCheckpointError(f"chunks {chunks[:1]}... hold {position} bytes, their tensor {len(target)}")

    def _verified(self, chunk: str) -> bytes:
        path = self._file(chunk)
        try:
            stored = self.storage.read(path)
        except FileNotFoundError as err:
            raise CorruptCheckpointError(f"chunk {self.storage.path(path)} is missing") from err
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored) if chunk.endswith(".zst") else stored
        except zstandard.ZstdError as err:
            raise CorruptCheckpointError(f"chunk {self.storage.path(path)} is corrupted or truncated: {err}") from err
        if not matches(raw, chunk.split(".")[0]):
            raise CorruptCheckpointError(f"chunk {self.storage.path(path)} fails its checksum (corrupted or truncated)")
        return raw

    def all_chunks(self, temporary: bool = False) -> set[str]:
        """Ids of every stored chunk (with ``temporary``: the half-written files' paths instead)."""
        found = set()
        for prefix in self.storage.list("chunks"):
            for entry in self.storage.list(f"chunks/{prefix}"):
                if (".tmp-" in entry) == temporary:
                    found.add(f"chunks/{prefix}/{entry}" if temporary else entry)
        return found

    def delete(self, chunks: set[str]) -> None:
        for chunk in chunks:
            self.storage.remove(self._file(chunk))
            self._known.pop(chunk.split(".")[0], None)


@dataclass
class Manifest:
    name: str
    created: float
    step: int = 0
    epoch: int = 0
    chunks: list[str] = field(default_factory=list)
    metadata_digest: str = ""
    logical_bytes: int = 0
    written_bytes: int = 0
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        fields = json.loads(data)
        fields.setdefault("format", 1)  # written before formats were recorded: BLAKE2b-128
        return cls(**fields)


class CheckpointCatalog:
    """The committed checkpoints under a storage root, newest last."""

    def __init__(self, store: ChunkStore) -> None:
        self.store, self.storage = store, store.storage

    def commit(self, manifest: Manifest, metadata: bytes) -> None:
        manifest.metadata_digest = digest(metadata)
        self.storage.write_atomic(f"checkpoints/{manifest.name}/{METADATA}", metadata)
        self.storage.write_atomic(f"checkpoints/{manifest.name}/{MANIFEST}", manifest.to_json())
        self.storage.write_atomic(LATEST, manifest.name.encode())

    def manifests(self) -> list[Manifest]:
        found = []
        for name in self.storage.list("checkpoints"):
            path = f"checkpoints/{name}/{MANIFEST}"
            if self.storage.exists(path):
                try:
                    found.append(Manifest.from_json(self.storage.read(path)))
                except (ValueError, TypeError, KeyError):
                    continue  # an unreadable manifest is not a committed checkpoint
        return sorted(found, key=lambda m: (m.created, m.step))

    def get(self, name: str) -> Manifest:
        path = f"checkpoints/{name}/{MANIFEST}"
        if not self.storage.exists(path):
            committed = [m.name for m in self.manifests()]
            raise FileNotFoundError(
                f"no committed checkpoint {name!r} under {self.storage.url!r} (no {MANIFEST}); committed: {committed}"
            )
        return Manifest.from_json(self.storage.read(path))

    def metadata(self, manifest: Manifest) -> bytes:
        data = self.storage.read(f"checkpoints/{manifest.name}/{METADATA}")
        if not matches(data, manifest.metadata_digest):
            raise CorruptCheckpointError(
                f"{self.storage.path(f'checkpoints/{manifest.name}/{METADATA}')} fails its checksum (corrupted)"
            )
        return data

    def verify(self, manifest: Manifest) -> None:
        """Read back every chunk and the metadata; raises :class:`CorruptCheckpointError` naming the bad file."""
        self.metadata(manifest)
        for name in manifest.chunks:
            self.store.get([name])

    def retain(self, max_keep: int) -> list[str]:
        """Delete the oldest checkpoints beyond ``max_keep`` and the chunks only they referenced."""
        manifests = self.manifests()
        doomed, kept = manifests[:-max_keep], manifests[-max_keep:]
        for manifest in doomed:
            self.storage.remove(f"checkpoints/{manifest.name}/{MANIFEST}")
            self.storage.remove(f"checkpoints/{manifest.name}", recursive=True)
        referenced = {c for m in kept for c in m.chunks}
        self.store.delete({c for m in doomed for c in m.chunks} - referenced)
        return [m.name for m in doomed]

    def sweep_orphans(self) -> int:
        """Delete chunks and checkpoint folders no committed manifest references (saves that died)."""
        manifests = self.manifests()
        referenced = {c for m in manifests for c in m.chunks}
        orphans = self.store.all_chunks() - referenced
        self.store.delete(orphans)
        for partial in self.store.all_chunks(temporary=True):
            self.storage.remove(partial)
        committed = {m.name for m in manifests}
        for name in self.storage.list("checkpoints"):
            if name not in committed:
                self.storage.remove(f"checkpoints/{name}", recursive=True)
        return len(orphans)
