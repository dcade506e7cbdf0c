"""Checkpoint storage on any fsspec URL: atomic writes, retries with backoff, clear errors.

Contract of ``Storage(url, storage_options=None, retries=4, backoff=0.5)``:

* ``url`` is a local path, ``file://...``, ``memory://...``, ``s3://...`` (needs s3fs) or any fsspec URL. An
  unknown scheme or a missing backend raises ``ValueError`` naming the URL and what would work, at
  construction. :meth:`check_writable` writes and removes a probe file (raises ``PermissionError``).
* Paths given to methods are relative to the root, ``/``-separated.
* :meth:`write_atomic` makes a file appear complete or not at all: it writes ``<path>.tmp-<random>`` then
  moves it into place (a rename on local disks; on object stores a single PUT is already atomic, and
  the move is a server-side copy). Readers never see a partial file under the final name.
* Every operation that touches storage is retried ``retries`` times with exponential backoff (``backoff``
  seconds, doubling) on ``OSError`` and the transient errors fsspec backends raise; the last error is
  re-raised with the URL and the number of attempts in the message.

No Lightning imports.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import fsspec
from fsspec.core import url_to_fs

T = TypeVar("T")


class StorageError(OSError):
    """A storage operation failed after every retry."""


class Storage:
    def __init__(
        self, url: str, storage_options: Optional[dict[str, Any]] = None, retries: int = 4, backoff: float = 0.5
    ) -> None:
        url = str(url)
        try:
            self.fs, root = url_to_fs(url, **(storage_options or {}))
        except (ValueError, ImportError) as err:
            known = ", ".join(sorted(p for p in fsspec.available_protocols() if p in ("file", "memory", "s3", "gcs", "az", "hdfs")))
            raise ValueError(
                f"cannot open checkpoint storage {url!r}: {err}. Use a local path or an fsspec URL such as"
                f" file://, memory://, s3:// (pip install s3fs); known here: {known}."
            ) from err
        self.url, self.root = url, root.rstrip("/")
        self.retries, self.backoff = retries, backoff

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except (OSError, TimeoutError, ConnectionError) as err:
                if attempt == self.retries:
                    raise StorageError(f"{what} on {self.url!r} failed after {attempt + 1} attempts: {err}") from err
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def check_writable(self) -> None:
        """One attempt (no retries): a probe file written and removed at the root."""
        probe = self.path(f".write-probe-{uuid.uuid4().hex}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except OSError as err:
            raise PermissionError(f"checkpoint storage {self.url!r} is not writable: {err}") from err

    def write_atomic(self, relative: str, data: bytes | memoryview) -> None:
        final = self.path(relative)
        temporary = f"{final}.tmp-{uuid.uuid4().hex}"

        def write() -> None:
            parent = final.rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)
            with self.fs.open(temporary, "wb") as f:
                f.write(data)
            self.fs.mv(temporary, final)

        self._retry(f"write {relative}", write)

    def read(self, relative: str) -> bytes:
        return self._retry(f"read {relative}", lambda: self.fs.cat_file(self.path(relative)))

    def exists(self, relative: str) -> bool:
        return self._retry(f"stat {relative}", lambda: self.fs.exists(self.path(relative)))

    def list(self, relative: str) -> list[str]:
        """Names (not paths) directly under ``relative``; empty if it does not exist."""
        def ls() -> list[str]:
            if not self.fs.exists(self.path(relative)):
                return []
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(relative), detail=False)]

        return self._retry(f"list {relative}", ls)

    def size(self, relative: str) -> int:
        return self._retry(f"stat {relative}", lambda: int(self.fs.size(self.path(relative))))

    def remove(self, relative: str, recursive: bool = False) -> None:
        def rm() -> None:
            if self.fs.exists(self.path(relative)):
                self.fs.rm(self.path(relative), recursive=recursive)

        self._retry(f"remove {relative}", rm)
