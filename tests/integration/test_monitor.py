"""CommunicationMonitor on known synthetic workloads: injected delays in compute and in a collective show up
where they belong, stalls and tensor-parallel collectives too, the report renders, the Chrome trace holds every
rank's spans, and `lightning-ciuic advise` repeats the advice offline."""

import json
from html.parser import HTMLParser

import pytest
from lightning.pytorch import Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import AsyncCheckpointer, CommunicationMonitor, HybridParallelStrategy, SnapshotRecovery
from lightning_ciuic.advice.trace import chrome_trace
from lightning_ciuic.cli import main as cli_main
from lightning_ciuic.testing import SlowGradientSync, SlowRank
from tests.helpers import TINY_MODEL, loader

BATCH = 4


def _fit(tmp_path, devices, strategy, callbacks, steps=8):
    seed_everything(7)
    checkpointing = any(isinstance(c, AsyncCheckpointer) for c in callbacks)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        default_root_dir=tmp_path, callbacks=callbacks,
    )
    trainer.fit(DeepSeekMini(**TINY_MODEL), loader(steps * BATCH * devices, BATCH))
    return trainer, json.loads((tmp_path / "monitor" / "monitor.json").read_text())


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs, self.rects, self.items = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag == "svg":
            self.svgs.append(dict(attrs).get("class"))
        self.rects += tag == "rect"
        self.items += tag == "li"


def test_injected_delays_land_in_compute_and_in_the_collective(tmp_path, capfd):
    monitor = CommunicationMonitor(gather_every=2, measure_link=True)
    callbacks = [monitor, SlowRank([1], seconds_per_sample=0.03), SlowGradientSync([0], seconds=0.1)]
    trainer, record = _fit(tmp_path, 2, HybridParallelStrategy(start_method="forkserver"), callbacks)

    for key in ("step_ms", "compute_ms", "data_wait_ms", "dp_exposed_ms", "dp_comm_ms", "dp_bytes", "memory_mb",
                "rank0/compute_ms", "rank1/compute_ms"):
        assert f"monitor/{key}" in trainer.callback_metrics, key
    rank0, rank1 = record["profile"]["ranks"]
    assert rank1["compute"] >= 0.12 > rank0["compute"]  # 4 samples x 30 ms injected into rank 1's compute
    assert rank0["dp_exposed"] >= 0.1  # the delayed collective, waited for after backward
    # the collective's time holds the delay too (with one bucket launched by the last gradient, comm and exposed
    # time cover nearly the same interval, so neither bounds the other exactly)
    assert rank0["dp_comm"] >= 0.1 and rank0["dp_payload"] > 0 and rank0["dp_bytes"] > 0
    assert record["profile"]["bandwidth_bytes_per_s"] > 0 and len(record["windows"]) >= 3

    report = _Tags()
    report.feed((tmp_path / "monitor" / "report.html").read_text())
    assert report.svgs == ["chart breakdown", "chart heatmap", "chart bandwidth"] and report.rects > 10
    straggler = [line for line in capfd.readouterr().err.splitlines() if "slower than the others" in line]
    assert straggler and straggler[0].strip().startswith("- rank 1 is")

    with pytest.raises(SystemExit) as done:
        cli_main(["advise", str(tmp_path)])
    assert done.value.code == 0
    out = capfd.readouterr().out
    assert "rank 1 is" in out and "DynamicDataBalancer" in out


def test_tensor_parallel_collectives_stalls_and_the_trace(tmp_path):
    """dp 2 x tp 2 with snapshots and async checkpoints: tp collectives timed per axis, snapshot and checkpoint stalls
    in the breakdown, and a Chrome trace with every rank's tracks and spans."""
    monitor = CommunicationMonitor(gather_every=4, profile_every=2, measure_link=False, trace=True)
    strategy = HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="forkserver")
    callbacks = [monitor, SnapshotRecovery(snapshot_freq=3, store="memory"),
                 AsyncCheckpointer(str(tmp_path / "ckpt"), every_n_train_steps=3, save_interval=None)]
    _, record = _fit(tmp_path, 4, strategy, callbacks, steps=9)
    profile = record["profile"]
    assert (profile["dp"], profile["tp"], profile["dp_rank_of"]) == (2, 2, [0, 0, 1, 1])
    assert all(rank["tp_comm"] > 0 for rank in profile["ranks"])
    assert profile["bandwidth_bytes_per_s"] is None
    # Snapshots at steps 3 and 6, checkpoints at 3 and 6 inside the measured steps (9 is after the last step; 6 is
    # postponed while 3's write still runs, and a write still running at the end is in the trace, cut there).
    assert all(rank["snapshot_stall"] > 0 and rank["checkpoint_stall"] > 0 for rank in profile["ranks"])

    trace = json.loads((tmp_path / "monitor" / "trace.json").read_text())["traceEvents"]
    assert trace == chrome_trace(record["trace"])["traceEvents"]  # what `lightning-ciuic report` writes again
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert processes == {r: f"rank {r}" for r in range(4)}
    for rank in range(4):
        tracks = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name" and e["pid"] == rank}
        spans = [(tracks[e["tid"]], e["name"], e["cat"]) for e in trace if e["ph"] == "X" and e["pid"] == rank]
        assert sum(name.endswith("forward + backward") for track, name, _ in spans if track == "training") == 9
        kinds = {(track, cat) for track, _, cat in spans}
        assert {("training", "data"), ("training", "optimizer"), ("dp collectives", "dp"), ("tp collectives", "tp"),
                ("training", "snapshot"), ("training", "checkpoint"), ("checkpoint writer", "checkpoint")} <= kinds, kinds
        assert all(e["dur"] >= 0 for e in trace if e["ph"] == "X")
        for tid in tracks:  # Perfetto keeps every span: on a track, each ends before the next starts or holds it
            ends = []
            for e in sorted((e for e in trace if e["ph"] == "X" and e["pid"] == rank and e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
                while ends and ends[-1] <= e["ts"]:
                    ends.pop()
                assert not ends or e["ts"] + e["dur"] <= ends[-1], (tracks[tid], e)
                ends.append(e["ts"] + e["dur"])


def test_sharded_gathers_and_reduce_scatters_are_timed_and_counted(tmp_path, capfd):
    monitor = CommunicationMonitor(gather_every=4, measure_link=False)
    strategy = HybridParallelStrategy(data_parallel_size=2, data_parallel_shard_size=2, start_method="forkserver")
    _, record = _fit(tmp_path, 2, strategy, [monitor])
    profile = record["profile"]
    assert profile["dp_shard"] == 2
    assert all(rank["dp_gather"] > 0 and rank["dp_scatter"] > 0 for rank in profile["ranks"])
    assert all(rank["dp_comm"] >= rank["dp_gather"] + rank["dp_scatter"] - 1e-9 for rank in profile["ranks"])
    # Bytes per step as the collectives ran, against the ring formula for 2 ranks (half of each float32 tensor):
    # each block (a unit) gathered for forward and again for backward, the root's own parameters once, every
    # gradient reduce-scattered once. FSDP2 pads dim 0 to a multiple of the 2 ranks (3 packed experts: 4 rows).
    model = DeepSeekMini(**TINY_MODEL)

    def padded(p):
        return -(-p.shape[0] // 2) * 2 * p[0].numel()

    blocks = sum(padded(p) for p in model.model.layers.parameters())
    total = sum(padded(p) for p in model.parameters())
    expected = (2 * blocks + (total - blocks) + total) * 4 / 2
    assert all(rank["dp_bytes"] == pytest.approx(expected, rel=0.01) for rank in profile["ranks"])
    # Rank 0 holds half the parameters, and AdamW's two moments and the gradients of that half.
    assert profile["model_state_mb"] == pytest.approx(total / 2 * 4 * 4 / 2**20, rel=0.01)
    assert "sharded over dp_shard=2: parameter all-gathers" in capfd.readouterr().err


def test_pipeline_stages_and_their_waits_are_in_the_trace(tmp_path):
    monitor = CommunicationMonitor(gather_every=4, measure_link=False, trace=True)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, start_method="forkserver")
    _, record = _fit(tmp_path, 2, strategy, [monitor], steps=4)
    assert record["profile"]["pp"] == 2 and all(rank["pp_bubble"] > 0 for rank in record["profile"]["ranks"])
    for events in record["trace"]:
        chunks = [e for e in events if e[0] == "pp stages"]
        waits = [e for e in events if e[0] == "pp collectives"]
        # 2 micro-batches x (forward + backward) per step, 4 steps; every rank waits for its neighbour somewhere
        assert sum(name.endswith("forward_one_chunk") for _, name, *_ in chunks) == 8, chunks
        assert waits and all(cat == "pp" and end > start for _, _, cat, start, end in waits)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="gather_every must be an integer >= 1"):
        CommunicationMonitor(gather_every=0)
    with pytest.raises(ValueError, match="profile_every must be an integer >= 1"):
        CommunicationMonitor(profile_every=-1)
