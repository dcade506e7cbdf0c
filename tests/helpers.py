"""Shared test helpers: real multi-process runs on CPU with gloo, and a tiny copy of the main job's model."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_ciuic.parallel.shutdown import leave_at_exit, leave_process_groups
from lightning_ciuic.strategies.launchers import ForkserverHandoff, preload_forkserver
from lightning_ciuic.testing.ports import free_port

TINY_MODEL = dict(
    dim=32, n_layers=2, n_heads=2, kv_lora_rank=8, n_routed_experts=3, n_shared_experts=1,
    n_activated_experts=2, moe_inter_dim=16, dense_inter_dim=32, max_seq_len=16, lr=1e-2, weight_decay=0.0,
)
SEQ_LEN = 8


def _worker(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple, handoff: ForkserverHandoff) -> None:
    handoff.apply()  # forked from the forkserver: the caller's environment and streams, as a spawned process has them
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    leave_at_exit()  # after a failure too
    fn(rank, world_size, *args)
    leave_process_groups()


def run_workers(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined by a gloo group, forked from a
    forkserver that imported torch and Lightning once (a spawn imports them again: ``benchmarks/launch.py``), with the
    caller's environment and streams. An exception in any worker fails the calling test with that worker's traceback."""
    preload_forkserver()
    worker_args = (fn, world_size, free_port(), args, ForkserverHandoff())
    mp.start_processes(_worker, args=worker_args, nprocs=world_size, start_method="forkserver")


class ReplicaReport(Callback):
    """Rank 0 writes to ``path`` as JSON: the per-step losses, whether every data-parallel replica holds the same
    parameters as rank 0's (``replicas_identical``; compared over the dp group, local shards under tp/pp), and what
    :meth:`extra` adds."""

    def __init__(self, path) -> None:
        self.path, self.losses = str(path), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def extra(self, trainer) -> dict:
        return {}

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        from lightning_ciuic import parallel_context

        context = parallel_context(trainer)
        # Replicas hold equal tensors; shards (dp_shard) do not: compare over the replicas of this rank's shard.
        group = context.dp_group if not context.dims.sharded else None
        flat = torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in pl_module.parameters()])
        copies = [flat]
        if group is not None:
            copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, flat, group=group)
        if trainer.is_global_zero:
            report = {"losses": self.losses, "replicas_identical": all(torch.equal(c, flat) for c in copies)}
            with open(self.path, "w") as f:
                json.dump({**report, **self.extra(trainer)}, f)


class TokenWindows(Dataset):
    """Deterministic synthetic byte sequences: (inputs, next-byte targets)."""

    def __init__(self, n: int, seq_len: int = SEQ_LEN, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def loader(n: int, batch_size: int) -> DataLoader:
    return DataLoader(TokenWindows(n), batch_size=batch_size, shuffle=False)


def lightning_epoch_order(n: int, epoch: int = 0) -> list[int]:
    """The order in which Lightning's injected ``DistributedSampler`` (it always shuffles training data) walks
    epoch ``epoch`` of ``n`` samples, concatenated over ranks: rank ``r``'s ``i``-th batch of ``B`` samples is
    ``order[(i * B * dp) + r :: dp]`` restricted to that window, so global batch ``i`` is the contiguous window
    ``order[i * B * dp : (i + 1) * B * dp]``."""
    g = torch.Generator().manual_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)) + epoch)  # the sampler's seed + epoch
    return torch.randperm(n, generator=g).tolist()


def reference_training(
    module_factory: Callable[[], Any],
    steps: int,
    global_batch: int,
    clip: float | None = None,
    lr_at: Callable[[int], float] | None = None,
    batches: list[int] | None = None,
    num_samples: int | None = None,
    losses: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Single-process training: ``steps`` optimizer steps on the global batches a data-parallel run sees
    (optionally with the learning rate ``lr_at(step)``). ``batches``: which global batches of the first epoch of
    ``num_samples`` samples feed the steps (default: the first ``steps``, on into the next epochs)."""
    module = module_factory()
    assert all(p.dtype == torch.float64 for p in module.parameters()), "the reference trains in float64"
    optimizer = module.configure_optimizers()
    dataset = TokenWindows(num_samples or steps * global_batch)
    per_epoch = len(dataset) // global_batch
    for step, index in enumerate(batches if batches is not None else range(steps)):
        epoch, index = divmod(index, per_epoch)
        window = lightning_epoch_order(len(dataset), epoch)[index * global_batch : (index + 1) * global_batch]
        batch = (dataset.data[window, :-1], dataset.data[window, 1:])
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        loss = module.pipelined_loss(batch) if hasattr(module, "pipelined_loss") else module._loss(batch)
        loss.backward()
        if losses is not None:
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# Equivalence runs (reference and parallel) train in float64: ``Trainer(precision=PRECISION)`` and modules made
# with ``.double()`` (a spawned run hands its weights back into the main process's module, in that module's dtype).
PRECISION = "64-true"
# Lightning logs metrics in float32: a logged float64 loss (and its mean over replicas) is off by a few 2^-24.
LOGGED_LOSS_REL = 1e-6


def rounding_atol(steps: int, lr: float, dtype: torch.dtype = torch.float64, adam_eps: float = 1e-8, terms: int = 1024) -> float:
    """The largest parameter difference that rounding alone can make between two orders of summation after
    ``steps`` Adam(W) steps at ``lr``: a gradient summed over at most ``terms`` products of magnitude <= 1 (true of
    these tiny models) carries an error of at most ``terms * u`` (u: the dtype's unit roundoff; the standard
    bound for a sum), and Adam turns a gradient error dg into at most ``lr * dg / eps`` of parameter per step (the
    slope of g / (|g| + eps) at g = 0), never more than the ``lr`` a step moves at all. In float64 that is
    1.1e-5 lr per step; in float32 it is the whole step, which is why float32 runs cannot tell a bug from
    rounding under Adam."""
    unit_roundoff = torch.finfo(dtype).eps / 2
    return steps * lr * min(1.0, terms * unit_roundoff / adam_eps)


def assert_state_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], steps: int, lr: float = TINY_MODEL["lr"]) -> None:
    """Equal up to :func:`rounding_atol` of ``steps`` Adam steps at ``lr``; both states must be float64."""
    assert actual.keys() == expected.keys()
    atol = rounding_atol(steps, lr)
    for key in expected:
        for name, state in (("actual", actual), ("expected", expected)):
            if state[key].is_floating_point():
                assert state[key].dtype == torch.float64, f"{name} {key} is {state[key].dtype}: compare in float64"
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def assert_state_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit: the same layout and kernels ran the same steps (exact resume)."""
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{key} differs by {(actual[key] - expected[key]).abs().max()}"
