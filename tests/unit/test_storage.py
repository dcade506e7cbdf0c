"""Checkpoint storage against an object store without a network: a fake ``s3://`` file system (an fsspec
``AbstractFileSystem`` that records its calls and behaves as s3fs does where it matters: ``makedirs`` creates a
missing bucket, a missing bucket is ``FileNotFoundError``) stands in for s3fs. The writability check and writes
create no bucket; missing credentials are reported with the URL and how to give them; errors that retrying cannot
cure are raised at once, transient ones are retried. Local and ``memory://`` stores keep creating their folder. The
last test repeats the object-store cases through s3fs against moto's S3 server on loopback, when both are installed."""

import errno
import io
import os
import time

import pytest
from fsspec.registry import _registry
from fsspec.spec import AbstractFileSystem

from lightning_ciuic.checkpoint.storage import Storage, StorageCredentialsError, StorageError


class NoCredentialsError(Exception):
    """What botocore raises (``botocore.exceptions.NoCredentialsError``, not an ``OSError``) when it finds none."""

    fmt = "Unable to locate credentials"

    def __str__(self) -> str:
        return self.fmt


class FakeS3(AbstractFileSystem):
    """Buckets and objects in memory; ``fail`` (an exception) is raised by every operation on an object."""

    protocol = ("s3", "s3a")
    cachable = False
    root_marker = ""

    def __init__(self, buckets=("bucket",), **kwargs):
        super().__init__(**kwargs)
        self.buckets, self.objects, self.calls, self.fail = set(buckets), {}, [], None

    def _object(self, what, path):
        self.calls.append((what, path))
        if self.fail is not None:
            raise self.fail
        if path.split("/", 1)[0] not in self.buckets:
            raise FileNotFoundError(errno.ENOENT, "The specified bucket does not exist", path)

    def makedirs(self, path, exist_ok=False):  # s3fs: creates the bucket when it is missing
        self.calls.append(("makedirs", path))
        self.buckets.add(self._strip_protocol(path).split("/", 1)[0])

    mkdir = makedirs

    def _open(self, path, mode="rb", **kwargs):
        self._object(f"open {mode}", path)
        if "r" in mode:
            if path not in self.objects:
                raise FileNotFoundError(path)
            return io.BytesIO(self.objects[path])
        fs = self

        class Upload(io.BytesIO):
            def close(self):
                fs.objects[path] = self.getvalue()
                super().close()

        return Upload()

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        with self._open(path, "rb") as f:
            return f.read()

    def rm(self, path, recursive=False, maxdepth=None):
        path = self._strip_protocol(path)
        self._object("rm", path)
        self.objects.pop(path, None)

    def mv(self, path1, path2, **kwargs):
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        self._object("mv", path2)
        self.objects[path2] = self.objects.pop(path1)

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        self._object("info", path)
        if path in self.objects:
            return {"name": path, "size": len(self.objects[path]), "type": "file"}
        if any(name.startswith(path + "/") for name in self.objects) or path in self.buckets:
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path).rstrip("/")
        names = sorted({path + "/" + name[len(path) + 1:].split("/")[0] for name in self.objects if name.startswith(path + "/")})
        return [self.info(n) for n in names] if detail else names


@pytest.fixture
def s3(monkeypatch):
    """``s3://`` URLs open the fake (the registry entry is put back afterwards); s3fs need not be installed."""
    monkeypatch.setitem(_registry, "s3", FakeS3)


def test_the_writability_check_creates_no_bucket(s3):
    storage = Storage("s3://bucket/run-17")
    storage.check_writable()
    assert not [c for c in storage.fs.calls if c[0] == "makedirs"], storage.fs.calls
    probes = [path for what, path in storage.fs.calls if what == "open wb"]
    assert len(probes) == 1 and probes[0].startswith("bucket/run-17/.write-probe-")  # a probe object under the prefix
    assert storage.fs.objects == {}  # and removed

    typo = Storage("s3://buckett/run-17")
    with pytest.raises(PermissionError, match=r"'s3://buckett/run-17'.*bucket 'buckett' does not exist") as raised:
        typo.check_writable()
    assert "creates no bucket" in str(raised.value)
    assert typo.fs.buckets == {"bucket"} and not [c for c in typo.fs.calls if c[0] == "makedirs"]


def test_writes_to_an_object_store_create_no_bucket_and_need_no_folders(s3):
    storage = Storage("s3://bucket/run-17", backoff=0.001)
    storage.write_atomic("chunks/ab/ab12.zst", b"chunk")
    assert storage.read("chunks/ab/ab12.zst") == b"chunk" and storage.list("chunks/ab") == ["ab12.zst"]
    assert not [c for c in storage.fs.calls if c[0] == "makedirs"], storage.fs.calls

    typo = Storage("s3://buckett/run-17", backoff=0.001)
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        typo.write_atomic("chunks/ab/ab12.zst", b"chunk")
    assert typo.fs.buckets == {"bucket"}


def test_missing_credentials_name_the_url_and_how_to_give_them(s3):
    storage = Storage("s3://bucket/run-17", backoff=0.001)
    storage.fs.fail = NoCredentialsError()
    with pytest.raises(PermissionError, match="'s3://bucket/run-17'") as raised:
        storage.check_writable()
    message = str(raised.value)
    assert "Unable to locate credentials" in message
    assert all(hint in message for hint in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "storage_options"))
    assert isinstance(raised.value.__cause__, NoCredentialsError)

    storage.fs.calls.clear()
    with pytest.raises(PermissionError, match="AWS_ACCESS_KEY_ID"):
        storage.read("checkpoints/x/manifest.json")
    assert len(storage.fs.calls) == 1  # not retried: credentials do not appear by waiting


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(errno.EACCES, "Access Denied"),
        IsADirectoryError(errno.EISDIR, "Is a directory"),
        NotADirectoryError(errno.ENOTDIR, "Not a directory"),
        FileNotFoundError(errno.ENOENT, "The specified bucket does not exist"),
        OSError(errno.EROFS, "Read-only file system"),
    ],
    ids=lambda e: type(e).__name__ if type(e) is not OSError else errno.errorcode[e.errno],
)
def test_errors_that_retrying_cannot_cure_are_raised_at_once(s3, error):
    storage = Storage("s3://bucket/run-17", retries=4, backoff=0.5)
    storage.fs.fail = error
    started = time.perf_counter()
    with pytest.raises(type(error)) as raised:
        storage.write_atomic("chunks/ab/ab12.zst", b"chunk")
    assert raised.value is error and time.perf_counter() - started < 0.4  # no backoff: 0.5 s before the 2nd attempt
    assert len(storage.fs.calls) == 1, storage.fs.calls


@pytest.mark.parametrize(
    "error",
    [ConnectionError("connection reset"), TimeoutError("read timed out"), OSError(errno.ECONNRESET, "reset by peer"),
     OSError("Service Unavailable")],
    ids=["ConnectionError", "TimeoutError", "ECONNRESET", "OSError without errno"],
)
def test_transient_errors_are_retried(s3, error):
    storage = Storage("s3://bucket/run-17", retries=2, backoff=0.001)
    storage.fs.fail = error
    with pytest.raises(StorageError, match=r"read x on 's3://bucket/run-17' failed after 3 attempts"):
        storage.read("x")
    assert len(storage.fs.calls) == 3


def test_local_and_memory_stores_still_get_their_folder(tmp_path):
    Storage(str(tmp_path / "a" / "b")).check_writable()
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    memory = Storage("memory://ciuic-storage-test/run/nested")
    memory.check_writable()
    assert memory.fs.isdir("/ciuic-storage-test/run/nested") and memory.list("") == []
    memory.fs.rm("/ciuic-storage-test", recursive=True)


def test_against_a_real_s3_compatible_server_no_bucket_is_created_and_credentials_are_asked_for(monkeypatch, moto_endpoint):
    """The same through s3fs and botocore, against moto on loopback (skipped without the test extra)."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in (("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"), ("AWS_CONFIG_FILE", "/nonexistent"),
                        ("AWS_EC2_METADATA_DISABLED", "true")):  # no credentials from this machine either
        monkeypatch.setenv(name, value)
    endpoint = moto_endpoint
    options = {"key": "test", "secret": "test", **endpoint}
    Storage("s3://probe-bucket", options).fs.mkdir("probe-bucket")
    Storage("s3://probe-bucket/run", options).check_writable()
    typo = Storage("s3://probe-buckett/run", options)
    with pytest.raises(PermissionError, match="bucket 'probe-buckett' does not exist"):
        typo.check_writable()
    with pytest.raises(FileNotFoundError):
        typo.write_atomic("chunks/ab/ab12.zst", b"chunk")
    typo.fs.invalidate_cache()
    buckets = typo.fs.ls("")  # moto keeps its buckets per process, other tests' too
    assert "probe-bucket" in buckets and "probe-buckett" not in buckets
    anonymous = Storage("s3://probe-bucket/run", endpoint)
    with pytest.raises(StorageCredentialsError, match=r"'s3://probe-bucket/run'.*NoCredentialsError.*AWS_ACCESS_KEY_ID"):
        anonymous.check_writable()
