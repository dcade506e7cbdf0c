"""PowerSGD (Vogels et al., 2019): rank-``r`` gradient compression with warm-started power iteration.

Contract of ``PowerSGD(rank).allreduce_(key, x, shapes, group)``: ``x`` is a flat float32 bucket made of
tensors of the given ``shapes``; every tensor that is a matrix (2-D or more, viewed as
``shape[0] x rest``) with both sides larger than ``rank`` is replaced by the rank-``r`` approximation
``P Q^T`` of its average over ``group``; the others (biases, norms, small matrices) are averaged exactly.
One step costs two all-reduces of ``(m + n) r`` values per matrix instead of ``m n``. ``Q`` is kept per
bucket (``key``) and reused as the next step's starting point (the "warm start"); it is initialized from a
fixed seed, so identical on every rank. Returns ``(result, bytes_sent)``; ``x`` is overwritten with the
averaged approximation. Error feedback is applied by the caller.

No Lightning imports.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p).Q


class PowerSGD:
    name = "powersgd"

    def __init__(self, rank: int = 4) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd_rank must be an integer >= 1, got {rank!r} (4 is a common choice).")
        self.rank = rank
        self.q_memory: dict[str, list[torch.Tensor]] = {}

    def _is_compressed(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        rows, cols = shape[0], math.prod(shape[1:])
        return min(rows, cols) > self.rank

    def nbytes(self, shapes: list[torch.Size]) -> int:
        """Payload bytes of one step: (m + n) r floats per compressed matrix, every value of the rest."""
        total = 0
        for shape in shapes:
            if self._is_compressed(shape):
                total += (shape[0] + math.prod(shape[1:])) * self.rank
            else:
                total += math.prod(shape)
        return 4 * total

    def allreduce_(self, key: str, x: torch.Tensor, shapes: list[torch.Size], group: dist.ProcessGroup) -> int:
        world = dist.get_world_size(group)
        views, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            views.append(x[offset : offset + numel])
            offset += numel
        matrices = [(v.view(s[0], -1), s) for v, s in zip(views, shapes) if self._is_compressed(s)]
        exact = [v for v, s in zip(views, shapes) if not self._is_compressed(s)]
        if key not in self.q_memory:
            g = torch.Generator().manual_seed(0)
            self.q_memory[key] = [torch.randn(m.shape[1], self.rank, generator=g) for m, _ in matrices]
        qs = self.q_memory[key]
        sent = 0

        def mean_(flat: torch.Tensor) -> None:
            nonlocal sent
            if flat.numel():
                dist.all_reduce(flat, group=group)
                flat.div_(world)
                sent += 2 * (world - 1) * flat.numel() * 4 // world

        ps = [m @ q for (m, _), q in zip(matrices, qs)]  # P = M Q (Q warm-started)
        flat_p = torch.cat([p.reshape(-1) for p in ps]) if ps else torch.zeros(0)
        mean_(flat_p)
        ps = [_orthonormalize(p) for p in _split(flat_p, [p.shape for p in ps])]
        new_qs = [m.T @ p for (m, _), p in zip(matrices, ps)]  # Q = M^T P
        flat_rest = torch.cat([torch.cat([q.reshape(-1) for q in new_qs]) if new_qs else torch.zeros(0)]
                              + [v for v in exact])
        mean_(flat_rest)
        q_numel = sum(q.numel() for q in new_qs)
        averaged_qs = _split(flat_rest[:q_numel], [q.shape for q in new_qs])
        self.q_memory[key] = [q.clone() for q in averaged_qs]
        for (m, _), p, q in zip(matrices, ps, averaged_qs):
            m.copy_(p @ q.T)
        offset = q_numel
        for v in exact:
            v.copy_(flat_rest[offset : offset + v.numel()])
            offset += v.numel()
        return sent

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {k: [q.clone() for q in v] for k, v in self.q_memory.items()}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        self.q_memory = {k: [q.clone() for q in v] for k, v in state.items()}


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        out.append(flat[offset : offset + numel].view(shape))
        offset += numel
    return out
