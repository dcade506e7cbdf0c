"""PipelineRunner on real processes: every schedule gives the gradients and loss of single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_ciuic.parallel.pipeline import (
    PipelineRunner,
    balanced_split,
    partition,
    resolve_stages_per_rank,
    stage_ids_of_rank,
)
from lightning_ciuic.parallel.recompute import Recompute, recompute_blocks
from tests.helpers import run_workers

BLOCKS = [f"layers.{i}" for i in range(8)]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _reference(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model = Stack()
    loss = _loss(model(inputs), targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


SCHEDULES = [  # (schedule, gradient checkpointing, max_deferred_weight_backwards)
    ("gpipe", "none", None),
    ("1f1b", "full", None),  # with activation checkpointing
    ("interleaved_1f1b", "none", None),
    ("looped_bfs", "none", None),
    ("interleaved_zero_bubble", "full", None),
    ("zbv_zero_bubble", "selective", None),  # split backward: two passes through each recomputed region
    ("dualpipev", "selective", None),
    ("dualpipev", "selective", 0),  # the weight backwards run earlier (parallel/weight_backlog.py)
    ("interleaved_zero_bubble", "none", 1),
]


def _check_every_schedule(rank: int, world: int) -> None:
    torch.manual_seed(1)
    inputs, targets = torch.randn(8, 6), torch.randn(8, 6)
    ref_loss, ref_grads = _reference(inputs, targets)
    reference_outputs = Stack()(inputs).detach()
    for schedule, checkpointing, deferred in SCHEDULES:
        model = Stack()
        per_rank = resolve_stages_per_rank(schedule, 2 if schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble") else None)
        num_stages = world * per_rank
        my_stages = stage_ids_of_rank(rank, world, per_rank, schedule)
        stages = partition(model, BLOCKS, balanced_split([1] * 8, num_stages), my_stages)
        recompute_blocks([block for stage in stages for block in stage.blocks], Recompute.parse(checkpointing))
        runner = PipelineRunner(stages, my_stages, num_stages, schedule, 4, _loss, dist.group.WORLD, torch.device("cpu"))
        runner.max_deferred_weight_backwards = deferred
        for accumulation in (1, 2):  # the second run accumulates on top of the first: grads add up like plain backward
            loss = runner.run(inputs, targets, train=True, loss_divisor=2.0 if accumulation == 2 else 1.0)
            assert loss.item() == pytest.approx(ref_loss, rel=1e-5), schedule
        local = dict(model.named_parameters())
        assert local, "every rank holds some parameters"
        assert set(local) <= set(ref_grads), "parameter names are those of the unsplit model"
        for name, param in local.items():
            torch.testing.assert_close(param.grad, ref_grads[name] * 1.5, rtol=1e-5, atol=1e-6, msg=f"{schedule} {name}")
        assert runner.run(inputs, targets, train=False).item() == pytest.approx(ref_loss, rel=1e-5), schedule
        torch.testing.assert_close(runner.forward(inputs), reference_outputs, rtol=1e-5, atol=1e-6)
        assert not _receive_buffers_held(runner), schedule
        # the multi-stage runtimes' sends: most waited for as soon as they must have completed, not at the step's end
        waited_early = sum(release.waited_early for release in runner._releases.values() if release is not None)
        assert (waited_early > 0) == (schedule not in ("gpipe", "1f1b")), (schedule, waited_early)
        assert 0.0 <= runner.bubble < 1.0
        if deferred is not None:
            assert _most_deferred(runner._schedules["train", (8, 6)].pipeline_order_with_comms[rank]) <= deferred, schedule


def _most_deferred(actions: list) -> int:
    """The most weight backwards an order leaves pending when another computation starts."""
    pending = most = 0
    for action in actions:
        kind = action.computation_type.value
        if kind == "W":
            pending -= 1
        elif kind in ("F", "B", "I", "OVERLAP_F_B"):
            most = max(most, pending)
            pending += kind == "I"
    return most


def _receive_buffers_held(runner: PipelineRunner) -> list[int]:
    """The elements of the receive buffers the runner's stages hold between steps: none (a micro-batch's buffer lives
    from its receive to its forward or backward; torch's stages keep one per micro-batch from set-up on)."""
    schedules = runner._schedules.values()
    stages = [stage for s in schedules for stage in (s._stages if hasattr(s, "_stages") else [s._stage])]
    return [
        info.buffer.numel() for stage in stages for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in infos if not info.is_root_arg and info.buffer is not None and info.buffer.numel()
    ]


def test_every_schedule_matches_single_process():
    """On 2 processes, each schedule's loss and gradients (also accumulated over two calls, the second at half
    weight), its evaluation loss and its forward output equal single-process computation, with the split-backward
    schedules' weight backwards limited too (the order run defers no more); the multi-stage schedules
    wait for their sends early (parallel/pipeline_sends.py) and hold no receive buffer between steps."""
    run_workers(_check_every_schedule, 2)
