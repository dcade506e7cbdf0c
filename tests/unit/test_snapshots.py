"""Snapshots without Lightning: encoding and corruption, stores, the reaper, choice of snapshot, state capture."""

from __future__ import annotations

import os
import subprocess
import time
from collections import deque

import pytest

from lightning_ciuic.parallel.dims import ParallelDims
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_ciuic.callbacks.recovery import QuantumRecovery, SnapshotRecovery, loss_spike
from lightning_ciuic.checkpoint.snapshot import (
    CorruptSnapshotError,
    Holding,
    MemoryStore,
    ShmStore,
    claim_run_directory,
    decode_snapshot,
    encode_snapshot,
    peer_of,
    plan_restores,
    recovery_order,
    snapshot_header,
)
from lightning_ciuic.checkpoint.training_state import (
    capture_module,
    capture_optimizer,
    restore_module,
    restore_optimizer,
    rng_state,
    set_rng_state,
)
from lightning_ciuic.testing import FailAt
from lightning_ciuic.data.resume import PositionedDataLoader, positioned


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_snapshot_round_trip_and_header(compression):
    state = {"w": torch.arange(1000.0), "nested": [1, {"b": torch.ones(3)}]}
    blob = encode_snapshot(state, {"step": 7, "loss": 1.5}, compression)
    assert snapshot_header(blob[:4096])["step"] == 7
    decoded, header = decode_snapshot(blob)
    assert header["loss"] == 1.5 and header["compression"] == compression
    torch.testing.assert_close(decoded["w"], state["w"])
    torch.testing.assert_close(decoded["nested"][1]["b"], torch.ones(3))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_corrupt_or_truncated_snapshot_is_refused(compression):
    blob = encode_snapshot({"w": torch.randn(4096)}, {"step": 1}, compression)
    flipped = bytearray(blob)
    flipped[-10] ^= 0xFF
    with pytest.raises(CorruptSnapshotError, match="rank0@1: payload .* does not match its checksum"):
        decode_snapshot(flipped, "rank0@1")
    with pytest.raises(CorruptSnapshotError, match="does not match its checksum"):
        decode_snapshot(bytearray(blob[:-5]))
    with pytest.raises(CorruptSnapshotError, match="not a snapshot"):
        decode_snapshot(b"garbage")


@pytest.mark.parametrize("kind", ["memory", "shm"])
def test_stores_keep_list_and_drop(kind, tmp_path):
    store = MemoryStore() if kind == "memory" else ShmStore(tmp_path / "rank0")
    for step in (3, 6, 9):
        store.put(step, encode_snapshot({"s": torch.tensor(step)}, {"step": step, "loss": 1.0 / step}))
    assert sorted(store.headers()) == [3, 6, 9]
    assert decode_snapshot(store.get(6))[0]["s"].item() == 6
    store.drop(3)
    assert sorted(store.headers()) == [6, 9]
    with pytest.raises(KeyError):
        store.get(3)
    store.clear()
    assert store.headers() == {} if kind == "memory" else not (tmp_path / "rank0").exists()


def test_shm_store_leaves_no_half_written_snapshot(tmp_path):
    store = ShmStore(tmp_path)
    store.put(1, encode_snapshot({}, {"step": 1}))
    (tmp_path / ".2.123.tmp").write_bytes(b"CIUICSNP partial")  # a writer killed mid-write
    assert list(store.headers()) == [1]


def test_reaper_deletes_the_run_directory_when_its_owner_exits(tmp_path):
    owner = subprocess.Popen(["sleep", "30"])
    try:
        run = claim_run_directory(tmp_path / "run", owner.pid)
        ShmStore(run / "rank0").put(1, encode_snapshot({}, {"step": 1}))
        claim_run_directory(tmp_path / "run", owner.pid)  # a second rank (or a restart) starts no second reaper
        assert (run / "reaper").read_text().isdigit()
        time.sleep(1.5)
        assert run.exists()
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while run.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not run.exists()


def test_recovery_order():
    losses = {2: 1.5, 4: 0.9, 6: 1.2, 8: float("nan"), 10: None}
    assert recovery_order(losses, "latest") == [10, 8, 6, 4, 2]
    assert recovery_order(losses, "min_loss") == [4, 6, 2, 10, 8]
    assert recovery_order({2: 1.0, 4: 1.0}, "min_loss") == [4, 2]


def test_peers_are_on_another_node_when_there_is_one():
    assert [peer_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [peer_of(r, 2, 2) for r in range(2)] == [1, 0]
    assert [peer_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]


def test_loss_spike_rule():
    history = deque([2.0, 2.1, 1.9, 2.0, 2.2, 2.0, 1.8, 2.0, 2.1, 1.9], maxlen=50)
    assert loss_spike(9.0, history, 4.0).startswith("loss spike")
    assert loss_spike(7.9, history, 4.0) is None
    assert loss_spike(9.0, history, None) is None
    assert loss_spike(9.0, deque(list(history)[:5], maxlen=50), 4.0) is None  # too little history yet
    assert loss_spike(9.0, deque([2.0, 2.0], maxlen=2), 4.0) is not None  # a full short window is enough


def _model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(16, 4, generator=g)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_capture_and_restore_training_state_into_live_and_fresh_objects():
    model, optimizer = _model_and_adam()
    _train(model, optimizer, 3, seed=1)
    module_state, optimizer_state = capture_module(model), capture_optimizer(optimizer)
    expected_model, expected_opt = _model_and_adam()
    _train(expected_model, expected_opt, 3, seed=1)
    _train(expected_model, expected_opt, 2, seed=2)

    _train(model, optimizer, 4, seed=3)  # drift, then roll back in place
    restore_module(model, module_state)
    restore_optimizer(optimizer, optimizer_state)
    _train(model, optimizer, 2, seed=2)
    for actual, expected in zip(model.state_dict().values(), expected_model.state_dict().values()):
        torch.testing.assert_close(actual, expected)

    fresh_model, fresh_optimizer = _model_and_adam()  # a restarted process: no optimizer state yet
    restore_module(fresh_model, module_state)
    restore_optimizer(fresh_optimizer, optimizer_state)
    _train(fresh_model, fresh_optimizer, 2, seed=2)
    for actual, expected in zip(fresh_model.state_dict().values(), expected_model.state_dict().values()):
        torch.testing.assert_close(actual, expected)


def test_restore_refuses_another_model():
    model, _ = _model_and_adam()
    with pytest.raises(ValueError, match="does not fit this model"):
        restore_module(torch.nn.Linear(4, 1), capture_module(model))


def test_rng_state_round_trip():
    state = rng_state()
    first = torch.rand(3)
    set_rng_state(state)
    torch.testing.assert_close(torch.rand(3), first)


def test_positioned_loader_resumes_in_the_epoch_it_was_saved():
    dataset = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    plain = DataLoader(dataset, batch_size=4, sampler=sampler)
    sampler.set_epoch(2)
    full = [batch[0].tolist() for batch in plain]

    loader = positioned(plain)
    assert isinstance(loader, PositionedDataLoader) and positioned(loader) is loader and loader.source is plain
    loader.position = lambda: (2, 3)
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches_done": 3, "window": 8}
    loader.load_state_dict(state)
    loader.batch_sampler.sampler.set_epoch(2)  # Lightning does this through batch_sampler.sampler
    assert [batch[0].tolist() for batch in loader] == full[3:]
    assert [batch[0].tolist() for batch in loader] == full  # the skip happens once

    loader.load_state_dict({"epoch": 1, "batches_done": 3})  # saved in another epoch: no skip in this one
    assert [batch[0].tolist() for batch in loader] == full


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"snapshot_freq": 0}, "snapshot_freq must be an integer >= 1, got 0"),
        ({"max_snapshots": 0}, "max_snapshots must be an integer >= 1, got 0"),
        ({"recovery_strategy": "best"}, "recovery_strategy='best' is not one of 'latest', 'min_loss'"),
        ({"store": "disk"}, "store='disk' is not one of 'memory', 'shm', 'peer'"),
        ({"state_compression": "lz4"}, "state_compression='lz4' is not one of 'zstd', 'none'"),
        ({"loss_spike_factor": 1.0}, "loss_spike_factor must be > 1"),
    ],
)
def test_bad_arguments_are_refused_with_what_would_work(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SnapshotRecovery(**kwargs)


def test_seed_name_and_fault_arguments():
    assert QuantumRecovery is SnapshotRecovery
    with pytest.raises(ValueError, match="fault='explode' is not one of"):
        FailAt(3, "explode")
    with pytest.raises(ValueError, match="step must be an integer >= 1 \\(the first optimizer step is 1\\), got 0"):
        FailAt(0, "nan")


def test_default_store_root_exists():
    assert os.path.isdir(SnapshotRecovery().shm_root)


def _dims(world_size, tp=1, dp_shard=1, ep=1):
    return ParallelDims(pp=1, dp=world_size // tp, tp=tp, world_size=world_size, dp_shard=dp_shard, ep=ep)


def _holding(holder, step, world, rank, where="own", tp=1, dp_shard=1, ep=1):
    layout = _dims(world, tp, dp_shard, ep).layout_key(rank)
    return Holding(holder=holder, where=where, step=step, world_size=world, rank=rank, layout=layout)


def test_restore_plans_same_layout_prefer_own_and_newest():
    holdings = [_holding(0, 10, 2, 0), _holding(1, 10, 2, 1), _holding(0, 20, 2, 0)]  # rank 1 lost step 20
    plans = plan_restores(holdings, _dims(2))
    assert [p.step for p in plans] == [10]
    assert [s.holder for s in plans[0].sources] == [0, 1] and not plans[0].resharded
    holdings.append(_holding(0, 20, 2, 1, where="replica"))  # rank 0 keeps rank 1's copy
    plan = plan_restores(holdings, _dims(2))[0]
    assert plan.step == 20 and [(s.holder, s.rank, s.where) for s in plan.sources] == [(0, 0, "own"), (0, 1, "replica")]


def test_restore_plans_across_a_data_parallel_size_change():
    shrink = plan_restores([_holding(0, 30, 2, 1), _holding(5, 30, 2, 0)], _dims(1))  # a node left
    assert shrink[0].sources[0].holder == 0 and shrink[0].resharded
    grow = plan_restores([_holding(0, 30, 1, 0)], _dims(2))  # a node joined: it gets rank 0's state
    assert [s.holder for s in grow[0].sources] == [0, 0]
    tp_kept = plan_restores([_holding(0, 5, 2, 0, tp=2), _holding(1, 5, 2, 1, tp=2)], _dims(4, tp=2))
    assert [s.rank for s in tp_kept[0].sources] == [0, 1, 0, 1]  # the same tensor-parallel shard
    assert plan_restores([_holding(0, 5, 2, 0, tp=2), _holding(1, 5, 2, 1, tp=2)], _dims(2, tp=1)) == []


def test_a_grown_expert_parallel_run_takes_each_ranks_state_from_a_rank_holding_its_experts():
    """ep 2 over the data-parallel ranks: ranks 0, 2, ... hold the first half of the experts, 1, 3, ... the second.
    Grown from 2 to 4 ranks, rank 3 must take rank 1's state (the tensor-parallel coordinate, equal for all, took
    rank 0's: the other experts' weights in the shapes of its own)."""
    held = [_holding(0, 9, 2, 0, ep=2), _holding(1, 9, 2, 1, ep=2)]
    grown = plan_restores(held, _dims(4, ep=2))
    assert [s.rank for s in grown[0].sources] == [0, 1, 0, 1] and grown[0].resharded
    assert plan_restores(held, _dims(4)) == []  # without expert parallelism each rank needs every expert


def test_a_sharded_runs_snapshots_restore_only_into_the_same_layout():
    shards = [_holding(0, 7, 2, 0, dp_shard=2), _holding(1, 7, 2, 1, dp_shard=2)]  # each rank: half the model
    same = plan_restores(shards, _dims(2, dp_shard=2))
    assert [s.rank for s in same[0].sources] == [0, 1] and not same[0].resharded
    assert plan_restores(shards, _dims(1)) == []  # one shard is not the model: resume from a checkpoint
    assert plan_restores(shards, _dims(4, dp_shard=4)) == []
    assert plan_restores(shards, _dims(2)) == []  # replicated now: each rank would need the whole model
    replicated = [_holding(0, 7, 2, 0), _holding(1, 7, 2, 1)]
    assert plan_restores(replicated, _dims(2, dp_shard=2)) == []  # whole replicas do not fit shards either


@pytest.mark.parametrize(("dp_before", "dp_after"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_resharded_resume_sees_every_sample_of_the_epoch_once(dp_before, dp_after):
    """A membership change mid-epoch: ranks of the new data-parallel size continue at the first unseen sample."""
    dataset, per_rank, epoch = TensorDataset(torch.arange(96)), 3, 5

    def loaders(dp):
        out = []
        for rank in range(dp):
            sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=True, seed=11)
            loader = positioned(DataLoader(dataset, batch_size=per_rank, sampler=sampler))
            loader.batch_sampler.sampler.set_epoch(epoch)
            out.append(loader)
        return out

    before = loaders(dp_before)
    seen = []
    done = 4  # batches each rank finished before the change
    for loader in before:
        seen += [i for batch in list(loader)[:done] for i in batch[0].tolist()]
        loader.position = lambda: (epoch, done)
    state = before[0].state_dict()
    assert state["window"] == per_rank * dp_before
    for loader in loaders(dp_after):
        loader.load_state_dict(state)
        assert loader.resume_batch == (None if dp_after == dp_before else done * dp_before // dp_after)
        seen += [i for batch in loader for i in batch[0].tolist()]
    assert sorted(seen) == list(range(96))
