"""A forward and a backward of two micro-batches run as one pair, their expert all-to-alls in flight while the other
computes: DualPipe's overlap of one micro-batch's communication with another's computation.

Contract:

* :func:`run_pair(forward, backward)` runs the two callables, ``forward`` on the calling thread and ``backward`` on a
  helper thread, *one at a time*: the forward runs first; a side gives the turn to the other when it waits for an
  exchange it issued during its turn (:func:`before_wait`, called by the expert dispatch's asynchronous exchanges,
  :mod:`~lightning_ciuic.parallel.experts.overlap`), which stays in flight while the other side runs up to its own
  wait; the turn comes back there. When one side is done the other runs to its end. Only the side holding the turn
  computes or issues a collective, and it hands the turn over at the same points on every rank (every rank runs the
  same exchanges), so every process group sees its collectives in the same order on every rank: the pair computes
  exactly what the forward then the backward compute. An exception on either side is raised on the caller's thread
  once both have stopped (the other side runs to its end alone).
* :func:`in_pair` (inside one side of a pair, on its thread): the expert dispatch then runs each layer as one flow of
  asynchronous exchanges, not in two chunks. :func:`issued` marks that this side issued an exchange in its turn;
  :func:`before_wait` hands the turn over if it did (no-op outside a pair, or when the other side is done).
* ``PAIR_STATS``: pairs run and turns handed over, per process (the tests read them).

Threads are only the means to suspend a backward inside torch's autograd engine: at most one side runs at a time.
The helper thread runs under the caller's ``TorchDispatchMode`` stack (the planner's fake tensors, its memory, FLOP
and collective trackers; ``MemTracker`` around a real step): what a pair allocates, computes and sends is counted as
the caller's, in the order it happens; on a GPU it computes on the caller's current stream.

No Lightning imports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_ciuic import compat

_LOCAL = threading.local()
PAIR_STATS = {"pairs": 0, "turns": 0}


class _Turns:
    """Whose turn it is (side 0: the forward, side 1: the backward) and which sides are done."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.turn = 0
        self.done = [False, False]

    def wait_for_turn(self, side: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == side)

    def hand_over(self, side: int) -> None:
        with self.condition:
            if self.done[1 - side]:
                return
            self.turn = 1 - side
            PAIR_STATS["turns"] += 1
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == side)

    def finish(self, side: int) -> None:
        with self.condition:
            self.done[side] = True
            self.turn = 1 - side
            self.condition.notify_all()


def _side(
    turns: _Turns, side: int, work: Callable[[], Any], errors: list, modes: Optional[list] = None, stream: Any = None,
) -> None:
    if modes:
        compat.push_dispatch_modes(modes)
    if stream is not None:  # on a GPU the helper computes on the training thread's stream, as the pair's other side
        torch.cuda.set_stream(stream)
    _LOCAL.turns, _LOCAL.side, _LOCAL.issued = turns, side, False
    try:
        turns.wait_for_turn(side)
        work()
    except BaseException as error:  # re-raised by run_pair on the caller's thread
        errors.append(error)
    finally:
        _LOCAL.turns = None
        turns.finish(side)


def run_pair(forward: Callable[[], Any], backward: Callable[[], Any]) -> None:
    """``forward`` here and ``backward`` on a helper thread, taking turns at their exchanges (module docstring)."""
    turns, errors = _Turns(), []
    PAIR_STATS["pairs"] += 1
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    helper = threading.Thread(
        target=_side, args=(turns, 1, backward, errors, compat.dispatch_modes(), stream), name="paired backward", daemon=True,
    )
    helper.start()
    _side(turns, 0, forward, errors)
    helper.join()
    if errors:
        raise errors[0]


def _turns() -> Optional[_Turns]:
    return getattr(_LOCAL, "turns", None)


def in_pair() -> bool:
    """Whether this thread runs one side of a pair."""
    return _turns() is not None


def issued() -> None:
    """This side issued an exchange in its turn (no-op outside a pair)."""
    if _turns() is not None:
        _LOCAL.issued = True


def before_wait() -> None:
    """About to wait for an exchange: hand the turn over if this side issued one in its turn (module docstring)."""
    turns = _turns()
    if turns is not None and _LOCAL.issued:
        _LOCAL.issued = False
        turns.hand_over(_LOCAL.side)
