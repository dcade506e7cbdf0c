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

from lightning_ciuic.validation import check_int


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p).Q


class PowerSGD:
    name = "powersgd"

    def __init__(self, rank: int = 4) -> None:
        check_int("powersgd_rank", rank, note="4 is a common choice")
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
        flat_views = _split(x, [torch.Size([math.prod(s)]) for s in shapes])
        matrices = [v.view(s[0], -1) for v, s in zip(flat_views, shapes) if self._is_compressed(s)]
        exact = [v for v, s in zip(flat_views, shapes) if not self._is_compressed(s)]
        if key not in self.q_memory:
            g = torch.Generator().manual_seed(0)  # the same start on every rank
            # drawn on the CPU (the same numbers on every rank and device), then moved to the gradients' device
            self.q_memory[key] = [torch.randn(m.shape[1], self.rank, generator=g).to(x.device, x.dtype) for m in matrices]

        # a Q restored from a checkpoint arrives on the CPU: move it to the gradients' device once
        self.q_memory[key] = [q.to(x.device, x.dtype) for q in self.q_memory[key]]
        ps = [m @ q for m, q in zip(matrices, self.q_memory[key])]  # P = M Q (Q warm-started)
        flat_p = _mean_(_concat(ps, x.device), group, world)
        ps = [_orthonormalize(p) for p in _split(flat_p, [p.shape for p in ps])]
        qs = [m.T @ p for m, p in zip(matrices, ps)]  # Q = M^T P
        flat_rest = _mean_(_concat(qs + exact, x.device), group, world)  # the new Q and the exact part, one all-reduce
        rest = _split(flat_rest, [t.shape for t in qs + exact])
        averaged_qs, averaged_exact = rest[: len(qs)], rest[len(qs) :]
        self.q_memory[key] = [q.clone() for q in averaged_qs]
        for m, p, q in zip(matrices, ps, averaged_qs):
            m.copy_(p @ q.T)
        for v, averaged in zip(exact, averaged_exact):
            v.copy_(averaged)
        return 2 * (world - 1) * self.nbytes(shapes) // world  # two ring all-reduces of this payload

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


def _concat(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, device=device)


def _mean_(flat: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    if flat.numel():
        dist.all_reduce(flat, group=group)
        flat.div_(world)
    return flat
