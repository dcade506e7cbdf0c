"""The right samples on every rank, once: streaming and iterable loaders under tensor, pipeline and expert parallelism.

Every rank records the samples of each training batch (tests/loaders.py). Under each layout the ranks of one
data-parallel replica (tp peers, pp stages, ep peers among the tp peers) must have trained on the same batches, and
the replicas on disjoint shares that together are the epoch, each sample once. A loader split by the global rank is
stopped at the first step, with the loader named and the remedy; resumes (same layout, another one) see each sample
of the epoch once.
"""

from collections import Counter

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.deepseek import DeepSeekMini
from lightning_ciuic import DynamicDataBalancer, HybridParallelStrategy, ParallelDims
from lightning_ciuic.data.check import BatchMismatchError
from tests.helpers import TINY_MODEL
from lightning_ciuic.data.stages import roles
from tests.loaders import BATCH, N, Loaders, SeenSamples, reads_by_rank, seen_by_rank, write_litdata

LAYOUTS = {
    "dp1": dict(),  # one process
    "dp2": dict(data_parallel_size=2),
    "dp4": dict(data_parallel_size=4),
    "tp2": dict(tensor_parallel_size=2),
    "dp2xtp2": dict(data_parallel_size=2, tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
    "ep-over-tp2": dict(tensor_parallel_size=2, expert_parallel_size=2),
    "pp3": dict(pipeline_parallel_size=3, pipeline_schedule="gpipe", num_microbatches=2),  # pp rank 1: a middle stage
    "pp2xdp2-zbv": dict(  # V-shaped: pp rank 0 holds the first and the last stage, pp rank 1 two middle ones
        pipeline_parallel_size=2, data_parallel_size=2, pipeline_schedule="zbv_zero_bubble", num_microbatches=2
    ),
}


def _dims(layout: str) -> ParallelDims:
    args = LAYOUTS[layout]
    pp, tp = args.get("pipeline_parallel_size", 1), args.get("tensor_parallel_size", 1)
    dp = args.get("data_parallel_size", 1)
    return ParallelDims(pp=pp, dp=dp, tp=tp, world_size=pp * dp * tp)


@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory):
    pytest.importorskip("litdata", reason="litdata (test extra) is not installed")
    path = tmp_path_factory.mktemp("litdata") / "windows"
    write_litdata(path)
    return str(path)


def _source(kind: str, request) -> str:
    """The LitData directory a ``kind`` of loader reads (``""``: none); skips where its package is not installed."""
    if kind.startswith("stateful"):
        pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata (test extra) is not installed")
    return request.getfixturevalue("litdata_dir") if kind == "litdata" else ""


def _fit(kind: str, layout: str, out, litdata_dir: str = "", ckpt_path=None, **trainer_kwargs) -> Trainer:
    seed_everything(7)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = Trainer(
        strategy=HybridParallelStrategy(start_method="forkserver", **LAYOUTS[layout]), accelerator="cpu",
        devices=_dims(layout).world_size, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out,
        **{**trainer_kwargs, "callbacks": [SeenSamples(out), *trainer_kwargs.get("callbacks", [])]},
    )
    model = {**TINY_MODEL, "n_routed_experts": 4}  # experts the expert-parallel ranks can share
    trainer.fit(DeepSeekMini(**model), datamodule=Loaders(kind, litdata_dir, str(out)), ckpt_path=ckpt_path)
    return trainer


def _per_replica(out, dims: ParallelDims) -> list[list]:
    """Each replica's batches, after checking that every rank of the replica trained on the same ones."""
    seen = seen_by_rank(out, dims.world_size)
    replicas: dict[int, list] = {}
    for rank, batches in enumerate(seen):
        if batches and all(samples is None for _, _, samples in batches):
            continue  # a middle pipeline stage: it read nothing (test_middle_pipeline_stages_read_no_data...)
        first = replicas.setdefault(dims.dp_rank_of(rank), batches)
        assert batches == first, f"rank {rank} (replica {dims.dp_rank_of(rank)}) trained on {batches}, its peers on {first}"
    return [replicas[d] for d in range(dims.dp)]


def _samples(replicas: list[list]) -> Counter:
    return Counter(sample for batches in replicas for _, _, samples in batches for sample in samples)


CASES = [
    ("litdata", "tp2"), ("litdata", "dp2xtp2"), ("litdata", "pp2"), ("litdata", "pp3"), ("litdata", "ep-over-tp2"),
    ("stateful", "tp2"), ("stateful-sampler", "dp2xtp2"), ("hook", "dp2xtp2"), ("world", "dp2xtp2"), ("world", "pp2"), ("sampler", "dp2xtp2"), ("global", "dp2"),
    ("hook", "ep-over-tp2"),
]


@pytest.mark.parametrize("kind, layout", CASES, ids=[f"{k}-{layout}" for k, layout in CASES])
def test_each_rank_trains_on_what_the_layout_requires(kind, layout, tmp_path, request):
    litdata_dir = _source(kind, request)
    _fit(kind, layout, tmp_path, litdata_dir)
    dims = _dims(layout)
    replicas = _per_replica(tmp_path, dims)
    assert _samples(replicas) == Counter(range(N))  # disjoint, together the epoch, each sample once
    assert all(len(samples) == BATCH for batches in replicas for _, _, samples in batches)
    if kind == "litdata" and dims.dp == 1:  # the run: both tp ranks trained on samples 0, 1 / 2, 3 / ...
        assert [samples for _, _, samples in replicas[0]][:3] == [[0, 1], [2, 3], [4, 5]]


STAGE_CASES = [("recorded-stream", "pp3"), ("recorded-map", "pp3"), ("recorded-map", "pp2xdp2-zbv")]


@pytest.mark.parametrize("kind, layout", STAGE_CASES, ids=[f"{k}-{layout}" for k, layout in STAGE_CASES])
def test_middle_pipeline_stages_read_no_data_and_the_ends_read_each_sample_once(kind, layout, tmp_path):
    """Every rank's dataset records what it read: a middle stage nothing (its steps get a NotRead, as many as the
    others' batches, an unsized stream's end included); the first and the last stage of each replica read each
    sample of their share once, and train on the same batches; the replicas' shares are the epoch."""
    _fit(kind, layout, tmp_path)
    dims, args = _dims(layout), LAYOUTS[layout]
    schedule = args.get("pipeline_schedule", "1f1b")
    layout_roles = roles(dims.pp, 2 if schedule == "zbv_zero_bubble" else 1, schedule)
    assert "middle" in layout_roles
    reads, seen = reads_by_rank(tmp_path, dims.world_size), seen_by_rank(tmp_path, dims.world_size)
    replicas: dict[int, list] = {}
    for rank in range(dims.world_size):
        role = layout_roles[rank // (dims.dp * dims.tp)]
        if role == "middle":
            assert reads[rank] == [], f"rank {rank}, a middle stage, read samples {reads[rank]}"
            assert seen[rank] and all(samples is None for _, _, samples in seen[rank])
            continue
        trained = [sample for _, _, samples in seen[rank] for sample in samples]
        assert sorted(reads[rank]) == sorted(trained) and len(set(trained)) == len(trained), f"rank {rank} ({role})"
        first = replicas.setdefault(dims.dp_rank_of(rank), seen[rank])
        assert seen[rank] == first, f"rank {rank} ({role}) trained on {seen[rank]}, its replica's first on {first}"
    assert all(len(seen[r]) == len(seen[0]) for r in range(dims.world_size))  # every stage stepped alike
    assert _samples([replicas[d] for d in range(dims.dp)]) == Counter(range(N))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_loader_split_by_the_global_rank_is_stopped_naming_it_and_the_remedy(layout, tmp_path):
    with pytest.raises(BatchMismatchError) as raised:
        _fit("global", layout, tmp_path)
    message = str(raised.value)
    peers = "tensor-parallel peers" if layout == "tp2" else "pipeline stages"
    assert f"the {peers} of a data-parallel replica must train on the same batch" in message
    assert "at the first step they hold different ones: replica 0: 2 different batches" in message
    assert "the DataLoader over ByGlobalRank (an IterableDataset)" in message
    assert "set_data_parallel(rank, size)" in message and "lightning_ciuic.data_parallel_world()" in message
    assert message.count("HybridParallelStrategy") == 1  # said once, by rank 0
    assert not list(tmp_path.glob("rank*.json"))  # stopped before any rank finished training


@pytest.mark.parametrize("kind", ["litdata", "world"])
def test_the_data_balancer_refuses_an_iterable_or_streaming_loader_saying_why(kind, tmp_path, request):
    litdata_dir = _source(kind, request)
    with pytest.raises(TypeError) as raised:
        _fit(kind, "dp2", tmp_path, litdata_dir, callbacks=[DynamicDataBalancer(monitoring_freq=2)])
    message = str(raised.value)
    assert "needs a map-style dataset (__len__ and __getitem__)" in message and "so no share can move" in message
    assert ("LitData's StreamingDataset streams" in message) == (kind == "litdata")
    assert "Train it without DynamicDataBalancer" in message


RESUMES = [  # pp3: through a middle stage
    ("litdata", "dp2xtp2", "dp2xtp2"), ("litdata", "dp2", "dp2xtp2"), ("litdata", "dp4", "dp2"), ("litdata", "pp3", "pp3"),
    ("litdata", "pp2", "pp2"), ("stateful", "dp2xtp2", "dp2xtp2"), ("stateful-sampler", "dp4", "dp2"),
    ("litdata", "dp1", "dp2"), ("stateful-sampler", "dp1", "dp2"),  # more replicas: the epoch's batch counters move
]


@pytest.mark.parametrize("kind, first, second", RESUMES, ids=[f"{k}-{a}-to-{b}" for k, a, b in RESUMES])
def test_a_resume_sees_each_sample_of_the_epoch_once(kind, first, second, tmp_path, request):
    """Three steps (four into more replicas: a whole number of their global batches), a checkpoint, then the rest of
    the epoch in the same layout, with tp 1 -> 2, with dp 4 -> 2, with dp 1 -> 2. Into another dp size the loader
    continues at another batch index than the saved one; the epoch must end where the loader does (on more replicas
    it ended at the saved size's batch count before: the last batches were skipped)."""
    litdata_dir = _source(kind, request)
    checkpoints, steps = tmp_path / "ckpt", 4 if _dims(first).dp < _dims(second).dp else 3
    saving = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=steps, save_top_k=-1, save_last=False)
    _fit(kind, first, tmp_path / "first", litdata_dir, max_steps=steps, enable_checkpointing=True, callbacks=[saving])
    (checkpoint,) = checkpoints.iterdir()
    _fit(kind, second, tmp_path / "second", litdata_dir, ckpt_path=str(checkpoint))
    before = _per_replica(tmp_path / "first", _dims(first))
    after = _per_replica(tmp_path / "second", _dims(second))
    assert sum(len(batches) for batches in before) == steps * _dims(first).dp
    assert _samples(before) + _samples(after) == Counter(range(N))  # none skipped, none repeated
    start = steps * _dims(first).dp // _dims(second).dp  # where the loader continues, in the second layout's batches
    for batches in after:  # Lightning counts the epoch's batches from there: it ends where the loader does
        assert [(epoch, index) for epoch, index, _ in batches] == [(0, start + i) for i in range(len(batches))], batches
