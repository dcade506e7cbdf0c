"""A set-up error of a multi-process run is reported once, by the lowest rank that had it, and the run stops: from the
console script (popen ranks) as one error and a non-zero exit without the peers' tracebacks, from ``Trainer.fit``
(forkserver ranks) as the original exception in the calling process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from lightning.pytorch import Trainer

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from tests.helpers import TINY_MODEL, loader

ROOT = Path(__file__).resolve().parents[2]
TP_ERROR = "tensor_parallel_size=2 does not divide n_heads=3; use a tensor_parallel_size among [1, 3]."


class RefusesOptimizer(DeepSeekMini):
    """DeepSeekMini whose ``configure_optimizers`` (run inside the strategy's set-up) fails on the ranks ``refuse_on``."""

    def __init__(self, refuse_on: Optional[list[int]] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.refuse_on = list(refuse_on or [])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.global_rank in self.refuse_on:
            raise ValueError(f"rank {self.global_rank} refuses an optimizer")
        return super().configure_optimizers()


def _trainer(**strategy) -> Trainer:
    return Trainer(
        strategy=HybridParallelStrategy(start_method="forkserver", **strategy), accelerator="cpu", devices=2,
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


@pytest.mark.parametrize(
    "module, strategy, message",
    [
        (DeepSeekMini(**dict(TINY_MODEL, n_heads=3, dim=48)), dict(tensor_parallel_size=2), TP_ERROR),
        (RefusesOptimizer(refuse_on=[0, 1], **TINY_MODEL), {}, "rank 0 refuses an optimizer"),
        (RefusesOptimizer(refuse_on=[1], **TINY_MODEL), {}, "rank 1 refuses an optimizer"),
    ],
    ids=["every-rank-tp-validation", "every-rank-lowest-reports", "one-rank-the-others-wait-for-it"],
)
def test_fit_raises_the_set_up_error_of_the_lowest_failing_rank_as_itself(module, strategy, message, capfd):
    trainer = _trainer(**strategy)
    with pytest.raises(ValueError) as raised:
        trainer.fit(module, loader(8, 2))
    assert type(raised.value) is ValueError and str(raised.value) == message  # not a ProcessRaisedException
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "HybridParallelStrategy.setup failed on rank(s)" in notes and "raised on rank" in notes, notes
    out, err = capfd.readouterr()
    assert message not in out + err and "Traceback" not in out + err, (out + err)[-3000:]  # the ranks printed nothing


def test_a_trainer_whose_set_up_failed_can_fit_again():
    trainer = _trainer()
    with pytest.raises(ValueError, match="rank 1 refuses an optimizer"):
        trainer.fit(RefusesOptimizer(refuse_on=[1], **TINY_MODEL), loader(8, 2))
    trainer.fit(DeepSeekMini(**TINY_MODEL), loader(8, 2))  # not "Calling `trainer.fit()` twice ... is not supported"
    assert trainer.state.finished


def _console_script(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    command = [
        sys.executable, "-m", "lightning_ciuic.cli", "fit", "--config", str(ROOT / "examples/configs/demo.yaml"),
        "--trainer.devices=2", "--trainer.strategy.data_parallel_size=auto", "--trainer.enable_progress_bar=false",
        *args,
    ]
    done = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    return done, done.stdout + done.stderr


def test_console_script_reports_a_set_up_error_of_every_rank_once(tmp_path):
    """The issue's example: the tensor-parallel check fails on both ranks; rank 0 says so once and the run exits 1
    (before: the traceback of each rank, 87 lines with the sentence twice, more with more ranks)."""
    done, output = _console_script(tmp_path, "--model.n_heads=3", "--trainer.strategy.tensor_parallel_size=2")
    assert done.returncode in (1, 2), output[-3000:]
    assert output.count(TP_ERROR) == 1 and output.count("Traceback") <= 1, output
    assert f"[rank0]: ValueError: {TP_ERROR}" in output
    assert "[rank1]" not in output and "Connection closed" not in output, output
    assert len(output.splitlines()) < 60, output


def test_console_script_reports_the_error_of_the_one_rank_that_failed(tmp_path):
    """Only rank 1 fails (in configure_optimizers, inside the strategy's set-up): rank 0 waits for it at the vote,
    then stops without a word and with a non-zero status; rank 1 reports."""
    done, output = _console_script(
        tmp_path, "--model=tests.integration.test_setup_errors.RefusesOptimizer", "--model.refuse_on=[1]",
    )
    assert done.returncode != 0, output[-3000:]
    assert output.count("rank 1 refuses an optimizer") == 1 and output.count("Traceback") <= 1, output
    assert "[rank1]: ValueError: rank 1 refuses an optimizer" in output
    assert "[rank0]" not in output and "Connection closed" not in output, output
