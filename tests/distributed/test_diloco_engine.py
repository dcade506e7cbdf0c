"""DiLoCoEngine on a real gloo group (2 replicas, float64) against the definition written over one flat vector: each
fragment is a run of the parameters laid end to end (here crossing tensor boundaries), its round staggered; at the
end of a round the replicas' mean pseudo-gradient takes a Nesterov SGD step from the start-of-round values, and every
replica continues from the result."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_ciuic.comm.diloco import DiLoCo, DiLoCoEngine
from lightning_ciuic.comm.reduction import ReductionGroup
from tests.helpers import run_workers

SIZES, STEPS, WORLD = (7, 13, 4), 12, 2
CONFIG = DiLoCo(sync_every=4, fragments=3, outer_lr=0.7, outer_momentum=0.9)


def _inner_step(step: int, rank: int) -> torch.Tensor:
    """What replica ``rank``'s inner optimizer adds at ``step`` (the whole model, flat)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(sum(SIZES), generator=g, dtype=torch.float64) * 0.1


def _reference() -> list[torch.Tensor]:
    """Each replica's model after ``STEPS`` inner steps, by the definition, on one flat vector (they differ in the
    fragments whose round is under way)."""
    total = sum(SIZES)
    bounds = [total * k // CONFIG.fragments for k in range(CONFIG.fragments + 1)]
    replicas = [torch.zeros(total, dtype=torch.float64) for _ in range(WORLD)]  # every replica starts at 0
    start, momentum = torch.zeros(total, dtype=torch.float64), [None] * CONFIG.fragments
    for step in range(STEPS):
        for rank in range(WORLD):
            replicas[rank] += _inner_step(step, rank)
        for k in range(CONFIG.fragments):
            if (step + 1 - k * CONFIG.sync_every // CONFIG.fragments) % CONFIG.sync_every:
                continue
            run = slice(bounds[k], bounds[k + 1])
            pseudo = sum(start[run] - replica[run] for replica in replicas) / WORLD
            momentum[k] = pseudo.clone() if momentum[k] is None else CONFIG.outer_momentum * momentum[k] + pseudo
            start[run] -= CONFIG.outer_lr * (pseudo + CONFIG.outer_momentum * momentum[k])
            for replica in replicas:
                replica[run] = start[run]
    return replicas


def _engine_matches_the_flat_definition(rank, world):
    model = nn.ParameterList([nn.Parameter(torch.zeros(size, dtype=torch.float64)) for size in SIZES])
    engine = DiLoCoEngine(CONFIG)
    engine.setup(model, [ReductionGroup("dense", tuple(model.parameters()), init_device_mesh("cpu", (world,)))])
    assert any(len(fragment) > 1 for fragment in engine.fragments)  # a run that crosses tensors
    for step in range(STEPS):
        engine.before_step(step)
        with torch.no_grad():
            for p, delta in zip(model, _inner_step(step, rank).split(SIZES)):
                p.add_(delta)
        engine.after_optimizer_step()
    ours = torch.cat([p.detach() for p in model])
    torch.testing.assert_close(ours, _reference()[rank], rtol=0, atol=1e-14)  # float64: a few roundings of values ~1
    engine.close()


def test_engine_matches_the_flat_definition_with_fragments_across_tensors():
    run_workers(_engine_matches_the_flat_definition, WORLD)
