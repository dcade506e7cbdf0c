"""The chunk store and its checkpoints without a Trainer: incremental reuse, retention without leaks,
checksums that name the damaged file, "last" falling back, retries, deferred background errors, S3."""

import errno
import hashlib
import json
import os
import time

import pytest
import torch

from lightning_ciuic import AsyncCheckpointer, ChunkedCheckpointIO
from lightning_ciuic.checkpoint.dcp import load_full, save_full
from lightning_ciuic.checkpoint import incremental
from lightning_ciuic.checkpoint.incremental import CheckpointCatalog, ChunkStore, CorruptCheckpointError
from lightning_ciuic.checkpoint import storage as storage_module
from lightning_ciuic.checkpoint.storage import Storage, StorageError, page_aligned_empty


def _state(frozen: torch.Tensor, step: int) -> dict:
    return {"frozen": frozen, "trained": torch.full((1000,), float(step)), "optimizer_states": [{"state": {0: {"step": step}}}]}


def test_unchanged_tensors_are_referenced_not_rewritten_and_retention_leaks_nothing(tmp_path):
    store = ChunkStore(Storage(str(tmp_path)), chunk_bytes=64 * 1024)
    frozen = torch.randn(200_000)  # 800 kB of "frozen" weights, 13 chunks
    save_full(store, "c0", _state(frozen, 0), max_keep=2)
    catalog = CheckpointCatalog(store)
    first = catalog.get("c0")
    save_full(store, "c1", _state(frozen, 1), max_keep=2)
    second = catalog.get("c1")
    assert second.written_bytes < 0.05 * first.written_bytes  # only the small trained tensor and the skeleton
    save_full(store, "c2", _state(frozen, 2), max_keep=2)
    kept = catalog.manifests()
    assert [m.name for m in kept] == ["c1", "c2"]
    assert store.all_chunks() == {c for m in kept for c in m.chunks}  # no leak, nothing referenced missing
    restored = load_full(store, "c1")
    assert torch.equal(restored["frozen"], frozen) and restored["trained"][0] == 1
    assert restored["optimizer_states"][0]["state"] == {0: {"step": 1}}  # int keys survive


def test_zstd_only_where_it_pays(tmp_path):
    """fp32 weights shrink about 7% under zstd, not worth its CPU: stored raw; zeros and small integers compressed."""
    store = ChunkStore(Storage(str(tmp_path)))
    weights, zeros, counts = torch.randn(100_000), torch.zeros(100_000), torch.arange(100_000) % 7
    save_full(store, "c0", {"weights": weights, "zeros": zeros, "counts": counts})
    (weights_chunk,), (zeros_chunk,), (counts_chunk,) = (store.put(t.numpy().tobytes()) for t in (weights, zeros, counts))
    assert weights_chunk.endswith(".raw") and zeros_chunk.endswith(".zst") and counts_chunk.endswith(".zst")
    restored = load_full(store, "c0")
    assert all(torch.equal(restored[k], v) for k, v in {"weights": weights, "zeros": zeros, "counts": counts}.items())


def test_format_1_checkpoints_named_by_blake2b_still_load_and_verify(tmp_path, monkeypatch):
    store = ChunkStore(Storage(str(tmp_path)))
    weights = torch.randn(10_000, dtype=torch.float64)
    with monkeypatch.context() as old_writer:  # what format 1 wrote: BLAKE2b-128 names, no "format" in the manifest
        old_writer.setattr(incremental, "digest", lambda data: hashlib.blake2b(data, digest_size=16).hexdigest())
        save_full(store, "old", {"weights": weights, "step": 3})
    manifest_path = "checkpoints/old/manifest.json"
    fields = json.loads(store.storage.read(manifest_path))
    del fields["format"]
    store.storage.write_atomic(manifest_path, json.dumps(fields).encode())
    fresh = ChunkStore(Storage(str(tmp_path)))
    catalog = CheckpointCatalog(fresh)
    old = catalog.get("old")
    assert old.format == 1 and all(len(c.split(".")[0]) == 32 for c in old.chunks)
    catalog.verify(old)
    restored = load_full(fresh, "old")
    assert torch.equal(restored["weights"], weights) and restored["step"] == 3
    save_full(fresh, "new", {"weights": weights, "step": 4})  # written now: BLAKE3-256 names, format 2
    new = catalog.get("new")
    assert new.format == incremental.FORMAT == 2 and all(len(c.split(".")[0]) == 64 for c in new.chunks)
    assert torch.equal(load_full(fresh, "new")["weights"], weights)
    with pytest.raises(CorruptCheckpointError, match="fails its checksum|corrupted or truncated"):  # format 1 is checked
        _damage(fresh, "old", "flip")
        catalog.verify(old)


def _damage(store: ChunkStore, name: str, how: str) -> str:
    catalog = CheckpointCatalog(store)
    older = {c for m in catalog.manifests() if m.name != name for c in m.chunks}
    victim = next(c for c in catalog.get(name).chunks if c not in older)
    path = store.storage.path(store._file(victim))
    data = store.storage.fs.cat_file(path)
    with store.storage.fs.open(path, "wb") as f:
        f.write(data[: len(data) // 2] if how == "truncate" else bytes([data[0] ^ 0xFF]) + data[1:])
    return path


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_chunk_is_named_and_last_falls_back(tmp_path, how):
    io = ChunkedCheckpointIO(str(tmp_path))
    io.save_checkpoint(_state(torch.zeros(10), 1), "step=1")
    io.save_checkpoint(_state(torch.ones(10), 2), "step=2")
    io.wait()
    bad_file = _damage(io.store, "step=2", how)
    with pytest.raises(CorruptCheckpointError, match=bad_file.split("/")[-1]):
        io.load_checkpoint("step=2")
    with pytest.warns(UserWarning, match="'step=2' .* is damaged"):
        fallback = io.load_checkpoint("last")
    assert fallback["trained"][0] == 1
    with pytest.raises(CorruptCheckpointError):
        CheckpointCatalog(io.store).verify(CheckpointCatalog(io.store).get("step=2"))


def _dcp_failure(message: str) -> BaseException:
    """What DCP raises when a rank's read fails: a CheckpointException whose text is each rank's traceback."""
    from traceback import extract_tb

    from torch.distributed.checkpoint import CheckpointException

    try:
        raise CorruptCheckpointError(message)
    except CorruptCheckpointError as err:
        return CheckpointException("load failed", {0: (err, extract_tb(err.__traceback__)), 1: (err, extract_tb(err.__traceback__))})


def test_the_fall_back_warning_gives_the_reason_and_every_damaged_candidate_is_one_error(tmp_path):
    """Through DCP (a sharded checkpoint): the warning shows the chunk's sentence, not a line of the traceback text of
    DCP's exception; where every candidate is damaged, one error names them and the verify command."""
    io = ChunkedCheckpointIO(str(tmp_path))
    for step in (1, 2, 3):
        io.save_checkpoint(_state(torch.full((10,), float(step)), step), f"step={step}")
    io.wait()
    reason = "chunk /store/chunks/ab/abcd.zst fails its checksum (corrupted or truncated)"

    def load(name: str) -> str:
        if name != "step=1":
            raise _dcp_failure(reason)
        return name

    with pytest.warns(UserWarning) as warned:
        assert io.load_with_fallback("last", load) == "step=1"
    assert [str(w.message) for w in warned] == [
        f"checkpoint 'step=3' under {str(tmp_path)!r} is damaged ({reason}); trying 'step=2'.",
        f"checkpoint 'step=2' under {str(tmp_path)!r} is damaged ({reason}); trying 'step=1'.",
    ]

    def damaged(name: str) -> str:
        raise _dcp_failure(reason)

    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError) as raised:
        io.load_with_fallback("last", damaged)
    assert str(raised.value) == (
        f"every checkpoint under {str(tmp_path)!r} is damaged ('step=3', 'step=2', 'step=1'; the oldest: {reason})."
        f" `lightning-ciuic checkpoint verify {tmp_path}` re-reads every chunk and names the damaged files; restore them"
        " or remove the damaged checkpoint, then resume from an intact one, or start afresh without ckpt_path."
    )
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint 'step=2' under .* is damaged .*checkpoint verify {tmp_path} step=2`"):
        io.load_with_fallback("step=2", damaged)


def test_transient_write_errors_are_retried(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path), backoff=0.01)
    real_open, failures = storage.fs.open, []

    def flaky_open(path, mode="rb", **kwargs):
        if "w" in mode and len(failures) < 3:
            failures.append(path)
            raise ConnectionError("simulated network hiccup")
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(storage.fs, "open", flaky_open)
    store = ChunkStore(storage)
    save_full(store, "c", {"x": torch.arange(5)})
    assert len(failures) == 3 and torch.equal(load_full(store, "c")["x"], torch.arange(5))


def test_local_writes_of_page_aligned_buffers_bypass_the_page_cache_unless_refused(tmp_path, monkeypatch):
    data = page_aligned_empty((3 * 4096 + 5,), torch.uint8)  # an unaligned tail after three pages
    data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8))
    storage, direct = Storage(str(tmp_path)), []
    real_write_direct, real_open = storage_module._write_direct, os.open
    monkeypatch.setattr(storage_module, "_write_direct", lambda path, view: (direct.append(path), real_write_direct(path, view)))
    storage.write_atomic("aligned", data.numpy())
    storage.write_atomic("unaligned", data[1:].numpy())  # address not on a page: buffered
    assert len(direct) == 1 and storage.read("aligned") == data.numpy().tobytes()
    assert storage.read("unaligned") == data[1:].numpy().tobytes()

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    storage.write_atomic("refused", data.numpy())  # e.g. a file system without O_DIRECT: buffered from then on
    assert not storage.direct_io and storage.read("refused") == data.numpy().tobytes()
    assert sorted(storage.list("")) == ["aligned", "refused", "unaligned"]  # no temporary file left behind


def test_a_failed_background_save_is_raised_at_the_next_save(tmp_path, monkeypatch):
    io = ChunkedCheckpointIO(str(tmp_path))
    io.store.storage.retries, io.store.storage.backoff = 1, 0.01
    monkeypatch.setattr(io.store.storage.fs, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    io.save_checkpoint({"x": torch.ones(3)}, "a")  # returns at once; the write fails in the background
    with pytest.raises(StorageError, match="failed after 2 attempts: disk full"):
        io.save_checkpoint({"x": torch.ones(3)}, "b")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dirpath="nosuchscheme://bucket/x"), ValueError, "cannot open checkpoint storage 'nosuchscheme://bucket/x'"),
        (dict(dirpath="memory://x", max_keep=0), ValueError, "max_keep must be an integer >= 1"),
        (dict(dirpath="memory://x", save_interval=-1), ValueError, "save_interval must be >= 0 seconds"),
        (dict(dirpath="memory://x", every_n_train_steps=0), ValueError, "every_n_train_steps must be an integer >= 1 or None, got 0"),
        (dict(dirpath="memory://x", compression="lz4"), ValueError, "compression='lz4'; use 'zstd' or 'none'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        AsyncCheckpointer(**kwargs)


def test_unwritable_storage_is_reported():
    with pytest.raises(PermissionError, match="is not writable"):
        Storage("/etc/hostname/checkpoints").check_writable()  # below a file: cannot be a directory


def test_s3_through_a_real_s3_compatible_server(moto_endpoint):
    options = {"key": "test", "secret": "test", **moto_endpoint}
    Storage("s3://ckpt-bucket", options).fs.mkdir("ckpt-bucket")
    io = ChunkedCheckpointIO("s3://ckpt-bucket/run1", max_keep=1, storage_options=options)
    io.save_checkpoint(_state(torch.randn(5000), 1), "step=1")
    io.save_checkpoint(_state(torch.randn(5000), 2), "step=2")
    restored = io.load_checkpoint("last")
    assert restored["trained"][0] == 2
    assert [m.name for m in io.catalog.manifests()] == ["step=2"]
    io.teardown()
    # ckpt_path="last": Lightning checks the candidate with fsspec's default options, which cannot reach this
    # endpoint; AsyncCheckpointer names a marker that it can check and that loads the newest checkpoint
    from lightning.fabric.utilities.cloud_io import get_filesystem

    callback = AsyncCheckpointer("s3://ckpt-bucket/run1", storage_options=options)
    (marker,) = callback._find_last_checkpoints(trainer=None)
    assert get_filesystem(marker).exists(marker) and callback.io.manages(marker)
    assert callback.io.load_checkpoint(marker)["trained"][0] == 2
    callback.io.teardown()


def test_command_line_lists_verifies_and_exports(tmp_path, capsys):
    from lightning_ciuic.cli import main as cli_main

    url = str(tmp_path / "store")
    io = ChunkedCheckpointIO(url)
    io.save_checkpoint({**_state(torch.zeros(10), 1), "global_step": 1}, "step=1")
    io.save_checkpoint({**_state(torch.ones(10), 2), "global_step": 2}, "step=2")
    io.teardown()

    def run(*args):
        with pytest.raises(SystemExit) as done:
            cli_main(["checkpoint", *args])
        return done.value.code, capsys.readouterr().out

    code, out = run("ls", url)
    assert code == 0 and "step=1" in out and "step=2" in out
    with pytest.raises(SystemExit) as missing:
        cli_main(["checkpoint", "ls", str(tmp_path / "nowhere")])
    assert missing.value.code == 1 and "no checkpoints: " in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists(), "listing creates nothing"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as empty:
        cli_main(["checkpoint", "verify", str(tmp_path / "empty")])
    assert empty.value.code == 1 and "empty holds no committed checkpoint" in capsys.readouterr().err
    assert run("verify", url)[0] == 0
    bad_file = _damage(io.store, "step=2", "flip")
    code, out = run("verify", url)
    assert code == 1 and "DAMAGED  step=2" in out and bad_file.split("/")[-1] in out and "ok       step=1" in out
    code, out = run("export", url, "step=1", str(tmp_path / "plain.pt"))
    exported = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert code == 0 and exported["trained"][0] == 1 and exported["global_step"] == 1
    code, out = run("export", url, "step=1", str(tmp_path / "weights.safetensors"), "--format", "safetensors")
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "weights.safetensors")
    assert code == 0 and set(tensors) == {"frozen", "trained"} and tensors["trained"][0] == 1
    assert run("export", url, "step=1", str(tmp_path / "x"), "--format", "onnx")[0] == 2
    with pytest.raises(SystemExit) as not_hf:
        cli_main(["checkpoint", "export", url, "step=1", str(tmp_path / "hf"), "--format", "hf"])
    assert not_hf.value.code == 2 and "--format hf needs a HuggingFaceCausalLM checkpoint" in capsys.readouterr().err


def test_read_into_fills_a_tensor_from_verified_chunks_and_refuses_a_wrong_size(tmp_path):
    store = ChunkStore(Storage(str(tmp_path)), chunk_bytes=64 * 1024)
    saved = torch.randn(50_000, dtype=torch.float64)  # 400 kB: 7 chunks
    chunks = store.put(saved.numpy().tobytes())
    out = torch.empty(50_000, dtype=torch.float64)
    store.read_into(chunks, out)
    assert torch.equal(out, saved)
    bf16 = torch.empty(200, 1000, dtype=torch.bfloat16)  # any dtype and shape of the same 400 kB
    store.read_into(chunks, bf16)
    assert torch.equal(bf16.reshape(-1).view(torch.float64), saved)
    for wrong in (torch.empty(49_999, dtype=torch.float64), torch.empty(50_001, dtype=torch.float64)):
        with pytest.raises(CorruptCheckpointError, match="bytes"):
            store.read_into(chunks, wrong)


def test_an_abandoned_save_stops_before_its_next_chunk_and_never_commits(tmp_path, monkeypatch):
    io = ChunkedCheckpointIO(str(tmp_path))
    io.store.chunk_bytes = 64 * 1024
    written, original = [], io.store.storage.write_atomic

    def slow_write(path, data):  # a slow link: 0.1 s per chunk of 64 kB
        time.sleep(0.1)
        written.append(path)
        original(path, data)

    monkeypatch.setattr(io.store.storage, "write_atomic", slow_write)
    io.save_checkpoint({"x": torch.randn(400_000)}, "a")  # 1.6 MB: 25 chunks, 2.5 s of writing in the background
    time.sleep(0.35)
    start = time.monotonic()
    callback = AsyncCheckpointer(str(tmp_path))
    callback.io = io
    callback.on_exception(None, None, RuntimeError("a peer died"))
    io.teardown()  # returns after the chunk being written, not after all of them
    assert time.monotonic() - start < 1.0 and len(written) < 10
    assert io.catalog.manifests() == []  # never committed
    io.save_checkpoint({"x": torch.ones(3)}, "b")  # the next run's saves are not abandoned
    io.wait()
    assert [m.name for m in io.catalog.manifests()] == ["b"]
    callback.on_exception(None, None, KeyboardInterrupt())  # Ctrl-C: every rank is alive; the write may finish
    assert not io.store.abandon.is_set()
