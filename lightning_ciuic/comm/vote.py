"""StepVote: one batched agreement per training step between all ranks, on one control group.

Contract:

- Components ``register(name, width, provider)`` once, in the same order on every rank (Lightning sets callbacks
  up in the same order everywhere); ``provider(*context)`` returns this rank's ``width`` local values.
- ``result(name, key, *context)``: the first call for a new ``key`` (the step's identity, e.g.
  ``(global_step, batch_idx)``) asks *every* provider for its local values and sums them over the control group in
  one ``all_reduce`` of one float64 tensor; later calls with the same key read that sum. So however many
  components ask in a step, the ranks exchange one message. Every rank must ask for the same keys (the same
  components run on every rank). Values are sums: a flag (0 or 1) is raised somewhere when its sum is > 0 and
  everywhere when it equals ``world_size``; a mean is a sum divided by a summed count.
- ``gather(value)`` / ``all_ok(flag)``: rare, unbatched agreements (restores, rollbacks) on the same group.
- The control group is a gloo group beside training's (created on the first registration, collectively; none in
  one process). ``release(name, peer_may_be_gone)`` unregisters; the last release closes the group, without the
  closing barrier if any component said a peer may be gone (see :mod:`lightning_ciuic.comm.groups`).

No Lightning imports.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ciuic.comm.groups import close_group, side_group

Provider = Callable[..., Sequence[float]]


class StepVote:
    def __init__(self) -> None:
        self._providers: dict[str, tuple[int, Provider]] = {}
        self._group: Optional[dist.ProcessGroup] = None
        self._key: Optional[Hashable] = None
        self._sums: dict[str, tuple[float, ...]] = {}
        self._peer_may_be_gone = False
        self.rounds = 0  # all_reduces issued, for tests and telemetry

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The control group (``None`` in one process)."""
        return self._group

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group) if self._group is not None else 1

    def register(self, name: str, width: int, provider: Provider) -> None:
        if name in self._providers:
            raise ValueError(f"StepVote: {name!r} is already registered; registered: {sorted(self._providers)}.")
        if width < 1:
            raise ValueError(f"StepVote: {name!r} must vote at least one value, got width={width}.")
        if not self._providers and self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = side_group()
        self._providers[name] = (width, provider)
        self._key = None

    def release(self, name: str, peer_may_be_gone: bool = False) -> None:
        self._providers.pop(name, None)
        self._peer_may_be_gone |= peer_may_be_gone
        if not self._providers:
            close_group(self._group, together=not self._peer_may_be_gone)
            self._group, self._key, self._peer_may_be_gone = None, None, False

    def result(self, name: str, key: Hashable, *context: Any) -> tuple[float, ...]:
        """The sums over all ranks of ``name``'s values for ``key`` (one exchange per key for all components)."""
        if name not in self._providers:
            raise KeyError(f"StepVote: {name!r} is not registered; registered: {sorted(self._providers)}.")
        if key != self._key:
            self._sums = self._exchange(context)
            self._key = key
        return self._sums[name]

    def _exchange(self, context: tuple[Any, ...]) -> dict[str, tuple[float, ...]]:
        local: list[float] = []
        for name, (width, provider) in self._providers.items():
            values = [float(v) for v in provider(*context)]
            if len(values) != width:
                raise ValueError(f"StepVote: {name!r} registered {width} values but its provider returned {len(values)}.")
            local.extend(values)
        sums = torch.tensor(local, dtype=torch.float64)  # on the CPU: the control group is gloo, whatever trains
        if self._group is not None:
            dist.all_reduce(sums, group=self._group)
        self.rounds += 1
        flat, out, start = sums.tolist(), {}, 0
        for name, (width, _) in self._providers.items():
            out[name], start = tuple(flat[start : start + width]), start + width
        return out

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if self._group is None:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        flag = torch.tensor([0.0 if ok else 1.0])
        if self._group is not None:
            dist.all_reduce(flag, group=self._group)
        return not flag.item()
