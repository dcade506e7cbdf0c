"""ChunkedCheckpointIO: Lightning's CheckpointIO over content-addressed chunks on any fsspec storage.

Contract:

* ``trainer.save_checkpoint(path)`` and ``Trainer.fit(ckpt_path=...)`` use the chunk store at the IO's root URL
  when ``path`` is a bare name, ``"last"``, or a path under the root (the last component names the
  checkpoint; a ``manifest.json`` URL works too). Any other path is Lightning's plain file, written and read
  by ``TorchCheckpointIO`` as before (Lightning's spawn launcher hands weights back that way).
* Training stalls only for the *staging copy* of the state (tensors copied into host buffers kept between
  saves, :class:`Stager`; from a GPU into pinned buffers on a side stream, so the host does not wait); hashing, compression and writing run on one background thread at the lowest CPU
  priority (``hashlib`` and ``zstandard`` release the GIL on large buffers). At most one save is in flight: a new save first waits for the previous one. An error of a
  background save is raised at the next save, load or at ``teardown``, never lost.
* ``load_checkpoint`` of a damaged checkpoint (a chunk missing, truncated or failing its checksum): for ``"last"`` a
  warning names it and the reason and the next older one is tried; where none is intact (or the one named is damaged)
  one :class:`CorruptCheckpointError` names the checkpoint(s) and points to ``lightning-ciuic checkpoint verify``.
* With ``HybridParallelStrategy`` every rank stages and writes its own shards through DCP (:meth:`save_sharded`,
  reshardable to another layout); the background DCP collectives use a dedicated gloo process group, so they
  never interleave with training's collectives. With ``DDPStrategy`` (replicated state) rank 0 saves the whole
  checkpoint (:meth:`save_checkpoint`).
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Optional, TypeVar

import fsspec
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_ciuic.comm.groups import close_group, side_group
from lightning_ciuic.checkpoint.dcp import ChunkedReader, ChunkedWriter, load_full, save_full
from lightning_ciuic.checkpoint.incremental import LATEST, MANIFEST, CheckpointCatalog, ChunkStore, CorruptCheckpointError, SaveAbandoned
from lightning_ciuic.checkpoint.storage import Storage, page_aligned_empty
from lightning_ciuic.timeline import timeline

Compression = Literal["zstd", "none"]
T = TypeVar("T")


def _errors(err: BaseException) -> list[BaseException]:
    """``err``, or for DCP's ``CheckpointException`` the exceptions of its ranks (its text is their tracebacks)."""
    if isinstance(err, CheckpointException):
        return [f[0] if isinstance(f, tuple) and f and isinstance(f[0], BaseException) else f
                for f in (err.failures or {}).values()]
    return [err]


def _is_corruption(err: BaseException) -> bool:
    return any(isinstance(e, CorruptCheckpointError) or "CorruptCheckpointError" in str(e) for e in _errors(err))


def _first_line(err: BaseException) -> str:
    """The reason a checkpoint failed to load, one line: the first line of the first damaged chunk's error (not a line
    of the traceback text DCP's exception carries)."""
    errors = _errors(err)
    for e in sorted(errors, key=lambda e: not isinstance(e, CorruptCheckpointError)):
        text = str(e).strip()
        if text and isinstance(e, BaseException):
            return text.splitlines()[0]
    return type(errors[0] if errors else err).__name__


class Stager:
    """Copies a state's tensors into private host buffers kept between saves (the training stall).

    Reusing the buffers avoids allocating and first-touching a fresh copy of the state at every save, which is
    most of a plain clone's cost; the price is one resident host copy of the state. A buffer is reused only after
    the save that read it has finished (the IO waits for it before staging again). DTensors are staged as
    DTensors over their local shard.

    * CPU tensors: page-aligned buffers, copied now, so local storage writes them with ``O_DIRECT`` (no copy into
      the page cache).
    * CUDA tensors: pinned buffers, copied asynchronously on a side stream that first waits for the current one;
      the current stream then waits for the copies, so later kernels (the optimizer step) cannot change a tensor
      before it is copied, and the host does not wait at all. :meth:`synchronize` (the background writer calls
      it before reading) waits for the copies to land."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}  # per CUDA device: the side stream copies run on
        self._staging: set[torch.device] = set()  # CUDA devices the staging in progress copies from
        self._copied: list[Any] = []  # CUDA events recorded after each device's copies of the last staging

    def __call__(self, state: Any) -> Any:
        self._staging, self._copied = set(), []
        staged = self._staged(state, ())
        for device in self._staging:
            stream = self._streams[device]
            torch.cuda.current_stream(device).wait_stream(stream)
            self._copied.append(stream.record_event())
        return staged

    def synchronize(self) -> None:
        """Wait until the last staging's copies are in host memory (nothing to wait for on the CPU)."""
        for event in self._copied:
            event.synchronize()

    def _staged(self, state: Any, path: tuple) -> Any:
        if isinstance(state, DTensor):
            local = self._copy(state.to_local(), path)
            return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride())
        if isinstance(state, torch.Tensor):
            return self._copy(state, path)
        if isinstance(state, dict):
            return {k: self._staged(v, (*path, k)) for k, v in state.items()}
        if type(state) in (list, tuple):
            return type(state)(self._staged(v, (*path, i)) for i, v in enumerate(state))
        return copy.deepcopy(state)

    def _copy(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[path] = (
                torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)  # a D2H copy's host side
                if tensor.is_cuda else page_aligned_empty(tuple(tensor.shape), tensor.dtype)
            )
        if not tensor.is_cuda:
            return buffer.copy_(tensor)
        with torch.cuda.stream(self._side_stream(tensor.device)):
            return buffer.copy_(tensor, non_blocking=True)

    def _side_stream(self, device: torch.device) -> Any:
        """``device``'s side stream, made to wait for the current stream before this staging's first copy."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        if device not in self._staging:
            self._streams[device].wait_stream(torch.cuda.current_stream(device))
            self._staging.add(device)
        return self._streams[device]


def _lowest_priority() -> None:
    """Run the background writer at nice 19 (Linux threads have their own nice value): it uses the CPU time
    training leaves idle instead of taking it from training."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class ChunkedCheckpointIO(CheckpointIO):
    """Checkpoints as content-addressed chunks under ``url``; see the module docstring."""

    def __init__(
        self,
        url: str,
        max_keep: Optional[int] = None,
        compression: Compression = "zstd",
        compression_level: int = 3,
        incremental: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        if compression not in ("zstd", "none", None):
            raise ValueError(f"compression={compression!r}; use 'zstd' or 'none'.")
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        codec = None if compression in ("none", None) else "zstd"
        self.store = ChunkStore(Storage(self.url, storage_options), codec, compression_level, incremental=incremental)
        self.catalog = CheckpointCatalog(self.store)
        self.max_keep = max_keep
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._group: Optional[dist.ProcessGroup] = None
        self.last_stall_seconds = 0.0
        self._plain = TorchCheckpointIO()
        self._stage = Stager()

    def manages(self, path: Any) -> bool:
        """Whether ``path`` is a checkpoint of this store (else a plain Lightning file)."""
        text = str(path)
        return (text in ("last", LATEST, self.latest_marker) or "/" not in text
                or text.startswith(self.url.rstrip("/") + "/"))

    # -- names ---------------------------------------------------------------------------------------
    @property
    def latest_url(self) -> str:
        """The pointer file ``"last"`` resolves to (what ``AsyncCheckpointer`` hands Lightning)."""
        return f"{self.url.rstrip('/')}/{LATEST}"

    @property
    def latest_marker(self) -> str:
        """A process-local ``memory://`` path standing for this store's newest committed checkpoint (see
        :meth:`mark_latest`)."""
        return f"memory://lightning-ciuic/{hashlib.sha256(self.url.encode()).hexdigest()[:16]}/{LATEST}"

    def mark_latest(self) -> str:
        """Create :attr:`latest_marker` and return it. Lightning resolves ``ckpt_path="last"`` by checking the
        candidate path with fsspec's default options, which cannot reach a store that needs ``storage_options``
        (an S3 endpoint, credentials); the marker always exists where it is checked, and loading it means "the
        newest committed checkpoint under :attr:`url`", with the same fallback as ``"last"``."""
        fsspec.filesystem("memory").pipe(self.latest_marker, self.url.encode())
        return self.latest_marker

    def candidates(self, path: Any) -> list[str]:
        """Checkpoint names to try for ``path``: for ``"last"`` (or the ``latest`` pointer) every committed
        checkpoint, newest first, so a corrupted one falls back to the next; otherwise just the one named."""
        text = str(path).rstrip("/")
        if text == "last" or text.endswith("/" + LATEST) or text == LATEST:
            names = [m.name for m in reversed(self.catalog.manifests())]
            if not names:
                raise FileNotFoundError(f"no committed checkpoint under {self.url!r}.")
            return names
        if text.endswith("/" + MANIFEST):
            text = text[: -len(MANIFEST) - 1]
        return [text.rsplit("/", 1)[-1]]

    def name_of(self, path: Any) -> str:
        return self.candidates(path)[0]

    def load_with_fallback(self, path: Any, load: Callable[[str], T]) -> T:
        """``load(name)`` for the first of :meth:`candidates` that is intact; a corrupted one is reported and,
        for ``"last"``, the next older one is tried (every rank sees DCP's gathered errors, so all agree)."""
        self.wait()
        names = self.candidates(path)
        for i, name in enumerate(names):
            try:
                return load(name)
            except (CorruptCheckpointError, CheckpointException) as err:
                if not _is_corruption(err):
                    raise
                if i == len(names) - 1:
                    raise self._damaged(names, _first_line(err)) from None
                rank_zero_warn(f"checkpoint {name!r} under {self.url!r} is damaged ({_first_line(err)}); trying {names[i + 1]!r}.")
        raise AssertionError("unreachable")

    def _damaged(self, names: list[str], reason: str) -> CorruptCheckpointError:
        """The one error for a load whose every candidate is damaged: names them and how to find the damaged files."""
        if len(names) == 1:
            what = f"checkpoint {names[0]!r} under {self.url!r} is damaged ({reason})"
            verify = f"lightning-ciuic checkpoint verify {self.url} {names[0]}"
        else:
            what = (f"every checkpoint under {self.url!r} is damaged ({', '.join(map(repr, names))}; the oldest:"
                    f" {reason})")
            verify = f"lightning-ciuic checkpoint verify {self.url}"
        return CorruptCheckpointError(
            f"{what}. `{verify}` re-reads every chunk and names the damaged files; restore them or remove the damaged"
            " checkpoint, then resume from an intact one, or start afresh without ckpt_path."
        )

    # -- background ----------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _stalled(self, start: float) -> None:
        """Training waited from ``start`` until now (the previous write, then staging)."""
        timeline.record("checkpoint staging", "checkpoint", start)
        self.last_stall_seconds = time.perf_counter() - start

    def _submit(self, job: Callable[[], None]) -> None:
        self.wait()  # at most one in flight; raises a previous background error here
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ciuic-checkpoint", initializer=_lowest_priority)
        self._pending = self._executor.submit(_timed_write, self._stage.synchronize, job)

    def checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group of all ranks for the background DCP collectives (created on first use, collectively)."""
        if self._group is None:
            self._group = side_group()
        return self._group

    # -- CheckpointIO --------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Whole-state save from this process (DDPStrategy's rank 0, single device)."""
        if not self.manages(path):
            self.wait()
            return self._plain.save_checkpoint(checkpoint, path, storage_options)
        start = time.perf_counter()
        self.wait()
        staged = self._stage(checkpoint)
        self._stalled(start)
        name, extra = self.name_of(path), {"step": checkpoint.get("global_step", 0), "epoch": checkpoint.get("epoch", 0)}
        self._submit(lambda: save_full(self.store, name, staged, self.max_keep, extra))

    def save_sharded(self, path: Any, state: Any, extra: dict[str, Any], write: Callable[[Any, StorageWriter, dist.ProcessGroup], None]) -> None:
        """Collective: stage ``state`` now, then ``write(staged, writer, group)`` in the background."""
        start = time.perf_counter()
        self.wait()
        staged = self._stage(state)
        self._stalled(start)
        writer = ChunkedWriter(self.store, self.name_of(path), self.max_keep, extra)
        group = self.checkpoint_group()
        self._submit(lambda: write(staged, writer, group))

    def reader(self, name: str) -> StorageReader:
        return ChunkedReader(self.store, name)

    @override
    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not self.manages(path):
            return self._plain.load_checkpoint(path, map_location, weights_only)
        return self.load_with_fallback(path, lambda name: load_full(self.store, name))

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if not self.manages(path):
            return self._plain.remove_checkpoint(path)
        self.wait()
        name = self.name_of(path)
        self.store.storage.remove(f"checkpoints/{name}/{MANIFEST}")
        self.store.storage.remove(f"checkpoints/{name}", recursive=True)
        self.catalog.sweep_orphans()

    @override
    def abandon(self) -> None:
        """Stop the write in flight before its next chunk, never to commit (the run failed: a peer that died cannot
        finish its part, and a restart should not wait for an upload). :meth:`teardown` then returns at once."""
        self.store.abandon.set()

    def teardown(self) -> None:
        """Collective when sharded saves were made: wait for the write in flight (or its abandonment), then close
        the checkpoint group together (a rank that leaves while a peer's gloo connection is open makes that peer
        abort)."""
        abandoned = self.store.abandon.is_set()
        try:
            self.wait()
        except (SaveAbandoned, CheckpointException, RuntimeError):
            if not abandoned:  # an abandoned save fails by design (DCP gathers the error from every rank)
                raise
        finally:
            self.store.abandon.clear()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            close_group(self._group)
            self._group = None


def _timed_write(copied: Callable[[], None], job: Callable[[], None]) -> None:
    """``job`` once the staged copies are in host memory (``copied`` waits for a GPU's), as a timeline span."""
    with timeline.span("checkpoint write", "checkpoint", track="checkpoint writer"):
        copied()
        job()
