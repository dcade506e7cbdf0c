"""A forkserver rank starts as a spawned one would: the caller's environment, streams, random state and flags, and a
module of its own (not the caller's memory)."""

import json
import multiprocessing.forkserver
import os
import sys

import torch
from lightning.pytorch import Callback, Trainer

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.strategies.launchers import preload_forkserver
from tests.helpers import TINY_MODEL, loader


class RecordRankStart(Callback):
    """Rank 0 writes what it started with to ``path``: an environment variable, its first random draw, the
    deterministic flag, whether its parameters live in shared memory; and says hello on stderr and stdout."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.is_global_zero:
            record = {
                "variable": os.environ.get("CIUIC_HANDOFF_CHECK"),
                "draw": torch.rand(1).item(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "shared": any(p.is_shared() for p in pl_module.parameters()),
            }
            with open(self.path, "w") as f:
                json.dump(record, f)
            print("rank 0 on stdout")
            print("rank 0 on stderr", file=sys.stderr)


def test_forkserver_rank_gets_the_callers_environment_streams_random_state_and_own_memory(tmp_path, monkeypatch, capfd):
    preload_forkserver()
    multiprocessing.forkserver.ensure_running()  # started before the variable is set (and capfd's files)
    monkeypatch.setenv("CIUIC_HANDOFF_CHECK", "set after the forkserver started")
    module = DeepSeekMini(**TINY_MODEL)
    module.share_memory()  # what pickling to a rank does to a CPU module; the rank must clone it
    trainer = Trainer(
        strategy=HybridParallelStrategy(data_parallel_size=2, start_method="forkserver"), accelerator="cpu", devices=2,
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordRankStart(tmp_path / "start.json")],
    )
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(11)
        expected_draw = torch.rand(1).item()
        torch.manual_seed(11)
        trainer.fit(module, loader(4, 1))
    finally:
        torch.use_deterministic_algorithms(False)
    record = json.loads((tmp_path / "start.json").read_text())
    assert record == {"variable": "set after the forkserver started", "draw": expected_draw, "deterministic": True, "shared": False}
    out, err = capfd.readouterr()
    assert "rank 0 on stdout" in out and "rank 0 on stderr" in err


def test_a_one_process_fit_leaves_the_callers_environment_so_a_later_launch_starts_its_ranks(tmp_path):
    """One process runs in the caller's process with no launcher: nothing of a launch (LOCAL_RANK, MASTER_PORT, ...)
    stays behind, so the next Trainer in that process starts its two ranks (it took itself for a launched rank 0 and
    waited for a rank 1 nobody started)."""
    names = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {name: os.environ.get(name) for name in names}
    for devices, start_method in ((1, "popen"), (2, "forkserver")):
        trainer = Trainer(
            strategy=HybridParallelStrategy(start_method=start_method), accelerator="cpu", devices=devices, max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(DeepSeekMini(**TINY_MODEL), loader(4, 1))
        assert trainer.world_size == devices and trainer.state.finished
        if devices == 1:
            assert {name: os.environ.get(name) for name in names} == before


def test_one_process_with_a_start_method_is_started_and_the_strategy_sets_up_without_a_module(tmp_path):
    """As DDPStrategy's: start_method="fork" (spawn, forkserver) starts its one process with the launcher (only
    "popen" runs one process in the caller's), and setup_environment() works with no LightningModule connected
    (collectives only), as Lightning's own tests use a strategy."""
    import torch.distributed as dist

    forked = Trainer(strategy=HybridParallelStrategy(start_method="fork"), accelerator="cpu", devices=1, logger=False)
    assert forked.strategy.launcher is not None and forked.strategy.launcher.is_interactive_compatible
    popen = Trainer(strategy=HybridParallelStrategy(), accelerator="cpu", devices=1, logger=False)
    assert popen.strategy.launcher is None
    popen.strategy.setup_environment()
    try:
        assert dist.is_initialized() and popen.strategy.device_mesh.size() == 1
    finally:
        popen.strategy.teardown()
    assert not dist.is_initialized()
