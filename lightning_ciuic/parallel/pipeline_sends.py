"""When a pipeline rank lets go of what it sent: the multi-stage schedules' sends waited once they must have completed.

Contract: torch's runtime of the multi-stage schedules (interleaved 1F1B, looped BFS, the zero-bubble ones, DualPipeV;
``_PipelineScheduleRuntime``, torch 2.13) waits for its point-to-point sends only at the end of the step, and a send's
work keeps its tensor until it is waited for: every activation and output gradient a rank sends would stay until the
step ends, memory that grows with the micro-batches (8 sends of 56 MiB a micro-batch on a rank of DeepSeek-V3 under
interleaved 1F1B over 8 ranks of 4 stages, docs/plan.md). :func:`release_points` reads the schedule's order with its communication (every rank's actions,
``compat.pipeline_order_with_comms``) and gives, for each of a rank's computations, the sends of that rank it may wait
for before running it: a send to rank ``P`` at the first computation after it that reads a receive from ``P`` which
``P`` sent after posting its receive of ours. By then ``P`` has posted that receive, so the send completes without
this rank: waiting for it cannot deadlock, and holds it no longer than ``P`` takes to receive it. A send no such receive
follows is waited for at the step's end, as torch does.

:class:`SendRelease` runs them: ``sending(kind, stage, microbatch)`` names the send batch a stage is about to make
(from its ``get_fwd_send_ops`` / ``get_bwd_send_ops``), :meth:`SendRelease.works` wraps the works torch's
``_batch_p2p`` returns for it (``compat.pipeline_send_works``, inside :meth:`SendRelease.step`), and ``before(kind, stage,
microbatch)``, called as a stage starts a forward (``"F"``) or a backward (``"B"``), waits for the sends released there
and drops their works (their tensors with them). The same points on a real process group and on the planner's fake
one, so the plan's memory is the run's. No Lightning imports.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

from lightning_ciuic import compat

Action = tuple[str, int, int]  # (kind, stage, micro-batch): kinds "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"
Key = tuple[str, int, int]  # a send ("SEND_F" | "SEND_B", stage, micro-batch), or a computation ("F" | "B", stage, mb)


def release_points(order: Mapping[int, Sequence[Action]], rank: int, stage_rank: Mapping[int, int]) -> dict[Key, list[Key]]:
    """For pipeline rank ``rank``: computation ``("F" | "B", stage, micro-batch)`` -> the sends of this rank to wait
    for before it (see the module docstring). ``order``: every rank's actions in order, communication included;
    ``stage_rank``: the rank holding each stage."""
    position = {peer: {action: i for i, action in enumerate(actions)} for peer, actions in order.items()}

    def receive_of(send: Action) -> tuple[int, int]:  # (peer, index of the peer's matching receive)
        kind, stage, microbatch = send
        to, recv = (stage + 1, "RECV_F") if kind == "SEND_F" else (stage - 1, "RECV_B")
        peer = stage_rank[to]
        return peer, position[peer][(recv, to, microbatch)]

    def send_of(receive: Action) -> tuple[int, int]:  # (peer, index of the peer's matching send)
        kind, stage, microbatch = receive
        frm, send = (stage - 1, "SEND_F") if kind == "RECV_F" else (stage + 1, "SEND_B")
        peer = stage_rank[frm]
        return peer, position[peer][(send, frm, microbatch)]

    pending: list[tuple[Action, int, int]] = []  # (send, peer, the peer's index of its receive)
    released: dict[Key, list[Key]] = defaultdict(list)
    for action in order[rank]:
        kind, stage, microbatch = action
        if kind in ("SEND_F", "SEND_B"):
            pending.append((action, *receive_of(action)))
        elif kind in ("RECV_F", "RECV_B"):
            peer, sent_at = send_of(action)
            ready = [p for p in pending if p[1] == peer and p[2] < sent_at]
            pending = [p for p in pending if p not in ready]
            released["F" if kind == "RECV_F" else "B", stage, microbatch] += [send for send, _, _ in ready]
    return dict(released)


class _ReleasableWork:
    """A send's work that :class:`SendRelease` may wait for early; torch's own wait at the step's end then returns."""

    def __init__(self, work: Any) -> None:
        self._work: Optional[Any] = work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        work, self._work = self._work, None
        return True if work is None else work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class SendRelease:
    """One schedule's release points on this rank, and the works of the sends in flight (see the module docstring)."""

    def __init__(self, points: Mapping[Key, Sequence[Key]]) -> None:
        self.points = {key: tuple(sends) for key, sends in points.items()}
        self._naming: Optional[Key] = None
        self._in_flight: dict[Key, list[_ReleasableWork]] = {}
        self.waited_early = 0  # send batches waited for before the step's end, over the runner's steps

    @classmethod
    def of(cls, schedule: Any, rank: int) -> Optional["SendRelease"]:
        """Pipeline rank ``rank``'s release points in ``schedule``; ``None`` for a schedule without a runtime order."""
        order = compat.pipeline_order_with_comms(schedule)
        if order is None:
            return None
        actions, stage_rank = order
        return cls(release_points(actions, rank, stage_rank))

    @contextmanager
    def step(self) -> Iterator[None]:
        """Inside, one step of the schedule: its send batches' works kept for an early wait; forgotten after."""
        try:
            with compat.pipeline_send_works(self.works):
                yield
        finally:
            self._in_flight.clear()

    def sending(self, kind: str, stage: int, microbatch: int) -> None:
        """The next send batch is ``kind`` (``"SEND_F"`` or ``"SEND_B"``) of ``stage`` and ``microbatch``."""
        self._naming = (kind, stage, microbatch)

    def works(self, sends_only: bool, works: list) -> list:
        """The works of a point-to-point batch (``compat.pipeline_send_works``; ``sends_only``: it only sends): a
        named send batch's wrapped and kept, any other batch's as they are."""
        key, self._naming = self._naming, None
        if key is None or not works or not sends_only:
            return works
        wrapped = [_ReleasableWork(work) for work in works]
        self._in_flight[key] = wrapped
        return wrapped

    def before(self, kind: str, stage: int, microbatch: int) -> None:
        """Waits for (and drops) the sends released before computation ``kind`` of ``stage`` and ``microbatch``."""
        for send in self.points.get((kind, stage, microbatch), ()):
            works = self._in_flight.pop(send, ())
            for work in works:
                work.wait()
            self.waited_early += bool(works)
