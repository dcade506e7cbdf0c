"""Checkpoint storage on any fsspec URL: atomic writes, retries with backoff, clear errors.

Contract of ``Storage(url, storage_options=None, retries=4, backoff=0.5)``:

* ``url`` is a local path, ``file://...``, ``memory://...``, ``s3://...`` (needs s3fs) or any fsspec URL. An
  unknown scheme or a missing backend raises ``ValueError`` naming the URL and what would work, at
  construction. :meth:`check_writable` writes and removes a probe file; it raises ``PermissionError`` naming the
  URL when that fails. On an object store (``s3://``, ``gs://``, ``az://``, ...: :data:`OBJECT_STORES`) it
  creates nothing but the probe object under the prefix: no bucket (s3fs's ``makedirs`` creates a missing one, so
  a mistyped name would become a new bucket); a missing bucket is reported as such. A local or other
  directory-based store gets its folder created first.
* On object stores writes create no folders either (keys need none; ``makedirs`` could create the bucket).
* Missing or incomplete credentials (botocore's ``NoCredentialsError``, Google's ``DefaultCredentialsError``, ...)
  raise :class:`StorageCredentialsError` (a ``PermissionError``) naming the URL and the ways to give them, from any
  operation, without retries.
* Paths given to methods are relative to the root, ``/``-separated.
* :meth:`write_atomic` makes a file appear complete or not at all: it writes ``<path>.tmp-<random>`` then
  moves it into place (a rename on local disks; on object stores a single PUT is already atomic, and
  the move is a server-side copy). Readers never see a partial file under the final name. On a local
  file system a page-aligned buffer (:func:`page_aligned_empty`) is written with ``O_DIRECT``: straight from
  memory to the device, without the CPU copy into the page cache (which costs more CPU than hashing the
  bytes); a file system that refuses ``O_DIRECT`` (tmpfs on older kernels) gets buffered writes.
* Every operation that touches storage is retried ``retries`` times with exponential backoff (``backoff``
  seconds, doubling) on transient errors: ``ConnectionError``, ``TimeoutError`` and any other ``OSError``
  (what fsspec backends raise for a failed request) except those retrying cannot cure, which are raised at once
  as they came: ``FileNotFoundError`` (a missing file or bucket), ``PermissionError``, ``IsADirectoryError``,
  ``NotADirectoryError``, ``FileExistsError`` and the errnos of :data:`PERMANENT_ERRNOS` (read-only, full disk,
  name too long). After the last attempt the error is re-raised as :class:`StorageError` with the URL and the
  number of attempts in the message.

No Lightning imports.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import mmap
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import fsspec
import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

T = TypeVar("T")


PAGE = 4096  # O_DIRECT wants the buffer's address, offsets and lengths aligned to the device's block size


OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})  # buckets, no folders
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
PERMANENT_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG})


class StorageError(OSError):
    """A storage operation failed after every retry."""


class StorageCredentialsError(PermissionError):
    """The storage backend found no (or incomplete) credentials for the URL."""


def _is_credentials_error(err: BaseException) -> bool:
    """botocore's ``NoCredentialsError``/``PartialCredentialsError``/``CredentialRetrievalError``, google-auth's
    ``DefaultCredentialsError``, ...: recognised by class name, so that no backend needs to be imported."""
    return any(c.__name__.endswith(("CredentialsError", "CredentialRetrievalError")) for c in type(err).__mro__)


def _is_transient(err: BaseException) -> bool:
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    return isinstance(err, OSError) and not isinstance(err, PERMANENT) and err.errno not in PERMANENT_ERRNOS


_CREDENTIALS_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or AWS_PROFILE"
          " naming a profile in ~/.aws/credentials, or pass storage_options={'key': ..., 'secret': ...} (or"
          " {'profile': ...}; {'anon': True} for a public bucket)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file (or run `gcloud auth application-default"
          " login`), or pass storage_options={'token': ...}",
    "az": "set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY), or pass"
          " storage_options={'account_name': ..., 'account_key': ...}",
}
_CREDENTIALS_HINTS.update(s3a=_CREDENTIALS_HINTS["s3"], gcs=_CREDENTIALS_HINTS["gs"], abfs=_CREDENTIALS_HINTS["az"],
                          abfss=_CREDENTIALS_HINTS["az"], adl=_CREDENTIALS_HINTS["az"])


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose data starts on a page boundary (anonymous memory map), so that
    :meth:`Storage.write_atomic` can write it with ``O_DIRECT``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _write_direct(path: str, view: memoryview) -> None:
    """Write ``view`` (page-aligned address) to a new file with ``O_DIRECT``; an unaligned tail goes through
    the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        done, aligned_end = 0, len(view) - len(view) % PAGE
        while done < aligned_end:
            done += os.write(fd, view[done:aligned_end])
        if done < len(view):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            while done < len(view):
                done += os.write(fd, view[done:])
    finally:
        os.close(fd)


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
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        self.protocol = protocols[0]
        self.object_store = bool(OBJECT_STORES.intersection(protocols))  # no folders; the root starts with the bucket
        self.direct_io = isinstance(self.fs, LocalFileSystem) and hasattr(os, "O_DIRECT")  # off once refused

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as err:
                if _is_credentials_error(err):
                    raise self._credentials_error(what, err) from err
                if not _is_transient(err):
                    if isinstance(err, OSError) and hasattr(err, "add_note"):  # Python >= 3.11: the URL in the traceback
                        err.add_note(f"{what} on {self.url!r}: not retried ({type(err).__name__} does not go away by retrying).")
                    raise
                if attempt == self.retries:
                    raise StorageError(f"{what} on {self.url!r} failed after {attempt + 1} attempts: {err}") from err
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _credentials_error(self, what: str, err: BaseException) -> StorageCredentialsError:
        hint = _CREDENTIALS_HINTS.get(self.protocol, "give the backend's credentials in storage_options (passed to fsspec)")
        return StorageCredentialsError(
            f"{what} on {self.url!r}: no usable credentials ({type(err).__name__}: {err}). To give them, {hint}."
        )

    @property
    def bucket(self) -> Optional[str]:
        """The bucket (container) of an object store's URL; ``None`` for other stores."""
        return self.root.lstrip("/").split("/", 1)[0] if self.object_store else None

    def check_writable(self) -> None:
        """One attempt (no retries): a probe file written and removed at the root; on an object store nothing
        else is created (no bucket, no folder)."""
        probe = self.path(f".write-probe-{uuid.uuid4().hex}")
        try:
            if not self.object_store:
                self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except FileNotFoundError as err:
            if not self.object_store:
                raise PermissionError(f"checkpoint storage {self.url!r} is not writable: {err}") from err
            raise PermissionError(
                f"checkpoint storage {self.url!r} is not writable: bucket {self.bucket!r} does not exist (or these"
                f" credentials cannot see it): {err}. Create the bucket or correct the URL; the check creates no bucket."
            ) from None  # the message holds the backend's; its chained tracebacks (s3fs, botocore) would triple it
        except OSError as err:
            raise PermissionError(f"checkpoint storage {self.url!r} is not writable: {err}") from err
        except Exception as err:
            if _is_credentials_error(err):
                raise self._credentials_error("writability check", err) from err
            raise

    def write_atomic(self, relative: str, data: bytes | memoryview) -> None:
        final = self.path(relative)
        temporary = f"{final}.tmp-{uuid.uuid4().hex}"
        view = memoryview(data).cast("B")

        def write() -> None:
            if not self.object_store:  # object keys need no folders, and makedirs could create the bucket
                self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            if not self._wrote_direct(temporary, view):
                with self.fs.open(temporary, "wb") as f:
                    f.write(view)
            self.fs.mv(temporary, final)

        self._retry(f"write {relative}", write)

    def _wrote_direct(self, path: str, view: memoryview) -> bool:
        """Whether ``view`` went to ``path`` with ``O_DIRECT`` (False: not local, too small or unaligned, or
        the file system refuses it, which turns direct writes off for this storage)."""
        if not self.direct_io or len(view) < PAGE or view.readonly or ctypes.addressof(ctypes.c_char.from_buffer(view)) % PAGE:
            return False
        try:
            _write_direct(path, view)
            return True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self.direct_io = False
            return False

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
