"""Real elastic training: two TorchElastic agents (`torchrun --nnodes=1:2`, c10d rendezvous) on this machine; one
is killed mid-run (agent and worker, as when a node is lost), the other continues alone, the killed one is started
again and the run returns to two nodes, ending at the loss of an uninterrupted run. Through both changes each sample
of the epoch is trained once by the updates the run kept, from a map-style dataset and from a LitData stream."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from examples.data import ByteCorpusDataModule
from examples.elastic import CORPUS, fingerprint, write_stream
from examples.elastic_scenario import run_scenario

pytestmark = pytest.mark.serial  # rendezvous and heartbeat deadlines: `make test` runs these alone


@pytest.mark.parametrize("source", ["map", "litdata"])
def test_losing_a_node_continues_on_one_and_a_rejoining_node_brings_the_run_back_to_two(source, tmp_path):
    """``map``: the corpus through Lightning's sampler; ``litdata``: LitData's ``StreamingDataLoader`` over a stream
    of exactly 45 global batches (the epoch ends at the last step), restored by LitData's elastic re-striping."""
    job_args: tuple[str, ...] = ()
    if source == "litdata":
        pytest.importorskip("litdata", reason="litdata (test extra) is not installed")
        write_stream(tmp_path / "stream", 45 * 8)
        job_args = ("--litdata", str(tmp_path / "stream"))
    result = run_scenario(
        tmp_path, steps=45, step_seconds=0.2, kill_at=10, alone_steps=6, job_args=job_args, reference=source == "map",
        reference_alongside=True,
    )
    assert result["to_one_node_s"] < 60, result
    # At most snapshot_freq, plus one: the job's progress line for a step is written before that step's snapshot,
    # so a kill between them counts the step as done and resumes from the snapshot before it.
    assert 0 < result["lost_on_kill"] <= 5 + 1, result
    assert result["accumulate_alone"] == [2], result  # global batch 8 kept: 4 per rank x 1 rank x 2
    assert result["lost_on_rejoin"] <= 1, result  # the SIGTERM snapshot: nothing, or the step in flight
    assert result["final"]["step"] == 45 and result["final"]["world"] == 2
    if source == "map":
        assert result["loss_difference"] <= 0.02, result
    assert result["decisions"] and all(d["action"] in ("scale_up", "scale_down", "hold") for d in result["decisions"])
    assert result["shared_memory_left"] == [], result["shared_memory_left"]
    # Each sample of the epoch once, over the updates the run kept (lost, alone on one node, rejoined): the global
    # batches of steps 1..45 are the epoch's first 45 x 8 samples (map: in Lightning's sampler order; litdata: the
    # whole stream), none skipped or repeated
    trained = [sample for step in range(1, 46) for sample in result["samples_by_step"][step]]
    assert all(len(result["samples_by_step"][step]) == 8 for step in range(1, 46)), "a global batch of 8 every step"
    expected = epoch_samples(45 * 8, shuffled=source == "map")
    assert Counter(trained) == Counter(expected), "the updates kept trained each sample of the epoch once"
    # ... and Lightning's batch index is the loader's position: a resume into another number of replicas moves the
    # epoch's batch counters to where the loader continues (else the epoch would end before the loader on more
    # replicas, skipping its last batches or, LitData, replaying its stream from the restore, and after it on fewer)
    off = [(step, world, epoch, batch) for step, world, epoch, batch in result["positions_kept"]
           if epoch != 0 or (batch + 1) * 4 * world != 8 * step]  # batches of 4 per rank, global batch 8
    assert not off, f"(step, world, epoch, batch index) where Lightning's count is not the loader's: {off}"


def epoch_samples(count: int, shuffled: bool = True) -> list[str]:
    """The first ``count`` training windows of epoch 0 of examples/elastic.py's data, as Lightning's sampler orders
    them (shuffled with the run's seed, 0; ``shuffled=False``: in order, as :func:`examples.elastic.write_stream`
    writes them), by :func:`examples.elastic.fingerprint`."""
    data = ByteCorpusDataModule(CORPUS, seq_len=32, batch_size=4)
    data.setup("fit")
    order = torch.randperm(len(data.train_set), generator=torch.Generator().manual_seed(0)).tolist()
    order = order if shuffled else list(range(len(data.train_set)))
    return [fingerprint(data.train_set[i][0]) for i in order[:count]]


def test_a_sharded_run_survives_the_same_and_resumes_from_resharded_checkpoints(tmp_path):
    """FSDP over every data-parallel rank (``data_parallel_shard_size="auto"``): 2 shards, then 1 rank, then 2 again.
    A sharded snapshot is one rank's half of the model: each change of membership resumes from the newest
    AsyncCheckpointer checkpoint (every 5 steps), which DCP reshards into the new layout."""
    result = run_scenario(
        tmp_path, steps=45, step_seconds=0.2, kill_at=10, alone_steps=5, job_args=("--sharded",), reference_alongside=True
    )
    assert result["resumed_from"] and all(r.startswith("checkpoint ") for r in result["resumed_from"]), result
    assert 0 < result["lost_on_kill"] <= 6 and result["lost_on_rejoin"] <= 6, result  # a checkpoint every 5 steps
    assert result["accumulate_alone"] == [2], result
    assert result["final"]["step"] == 45 and result["final"]["world"] == 2
    assert result["loss_difference"] <= 0.02, result
    assert result["shared_memory_left"] == [], result["shared_memory_left"]


def test_a_run_with_its_experts_sharded_rederives_the_expert_layout_at_each_world(tmp_path):
    """FSDP with the routed experts sharded 2 ways (``expert_parallel_size=2``) on nodes of 2 ranks: 4 ranks
    (efsdp 2 x ep 2), then 2 (ep 2 alone), then 4 again. Each restart builds the expert view of the new world and
    resumes from the newest checkpoint, which DCP reshards; the run ends at the loss of an uninterrupted one."""
    result = run_scenario(
        tmp_path, steps=30, step_seconds=0.1, kill_at=10, alone_steps=5, nproc_per_node=2,
        job_args=("--sharded", "--experts", "2", "--batch-size", "2"), reference_alongside=True,
    )
    assert result["resumed_from"] and all(r.startswith("checkpoint ") for r in result["resumed_from"]), result
    assert all("ep=2" in layout for layout in result["layouts"]), result["layouts"]
    assert {"world size 4", "world size 2"} <= {layout.rpartition("(")[2].rstrip(")") for layout in result["layouts"]}, result
    assert result["accumulate_alone"] == [2], result  # global batch 8: 2 per rank x 2 ranks x 2
    assert result["final"]["step"] == 30 and result["final"]["world"] == 4
    assert result["loss_difference"] <= 0.02, result
    assert result["shared_memory_left"] == [], result["shared_memory_left"]
