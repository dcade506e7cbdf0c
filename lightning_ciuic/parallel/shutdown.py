"""Leaving torch.distributed at process exit without gloo aborting the process.

A gloo process group runs its collectives on worker threads (``pt_gloo_runloop``), and a worker deletes each
finished collective's work object after the caller has already seen it complete. Deleting the Python tensors that
work held takes the GIL. If the main thread has meanwhile reached interpreter finalization, Python ends the worker
(``pthread_exit``) inside that deletion, a ``noexcept`` destructor, and the process aborts: "terminate called
without an active exception", SIGABRT, now and then, after training finished (seen in about 1 of 15 runs of a
two-rank tensor-parallel test; a core dump shows the worker in ``~AsyncBarrierWork`` -> ``~AsyncAllgatherCoalescedWork``
-> ``decref_pyobject`` -> ``PyThread_exit_thread``). ``destroy_process_group`` would join those threads, but a group
lives on while anything holds it: every ``DeviceMesh`` keeps its groups, and DTensor's redistribution caches keep
meshes, so in practice the threads outlive it.

:func:`leave_process_groups` is the end of a worker that finished: a barrier (no rank tears its gloo pairs down while a
peer still uses them), ``destroy_process_group``, then :func:`wait_for_idle_gloo_workers`: with the GIL released, wait
until every gloo worker thread is asleep and stays asleep (a thread waiting for the GIL wakes every switch interval,
an idle one does not). :func:`leave_at_exit` registers the same, without the barrier (a peer may be gone after a
failure), to run at interpreter exit while Python is still whole (:func:`leave_without_peers` runs it now). Linux (``/proc``);
elsewhere the wait is skipped.

A set-up that fails is left together too, so that its error is reported once, not once per rank followed by the
peers' gloo tracebacks. :func:`agree_on_setup` is a collective that every rank reaches at the end of its set-up,
whether its own failed (the exception) or not (``None``): one ``all_reduce`` of a flag per rank on
:func:`setup_vote_group`, a gloo group beside training's, made by every rank when its processes start (already
connected, so a peer that died before the vote fails it at once instead of after the timeout). Where nobody failed
it returns. Otherwise:

* the lowest failing rank raises its own exception, marked (:func:`is_reported_setup_failure`) and with a note
  naming the failing ranks;
* every other rank raises a :class:`PeerSetupFailed`, a ``SystemExit``: Python exits on it without a traceback, the
  multiprocessing launcher turns it into a quiet return. A rank whose own set-up failed raises its own error made
  quiet (an instance of both, with its message: ``except ValueError`` around ``fit`` behaves as before on every
  rank). The exit status is the caller's: 1 in the process the user started (the popen launcher's rank 0), 0 in the
  ranks it launched, so that Lightning's child-process observer does not kill the reporting rank before it reports.

:func:`raise_once` is the same ending for a failure every rank found alike (a collective's result, mid-training): rank 0
raises it, marked as reported, the others quietly, with exit status 0.

Errors after set-up that the ranks meet at the same point (restoring a checkpoint: a damaged or missing one, a
storage error, strict loading; a callback's refusal when fit starts) end the same way: a block run on every rank under
:func:`reported_once` votes at its end, failed or not, on the same group and with the same exit statuses
(:func:`setup_vote_group` keeps the one its caller gave), so its error too is reported once, by the lowest failing
rank, with a note naming the block. Where no vote group was made (one process, another strategy) the error is raised
as it came.

A rank that fails while its peers wait for it in another collective waits in the vote until the process-group
timeout, like them.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

GLOO_WORKER_THREAD = "pt_gloo_runloop"
_registered = False
_SETUP_FAILURE = "_lightning_ciuic_setup_failure"  # set on the exception the lowest failing rank raises
_vote_group: Optional[tuple[object, dist.ProcessGroup]] = None  # (the default group it was made in, the vote group)
_quiet_exit_code = 1  # a quiet rank's exit status, as setup_vote_group's caller gave it


def leave_process_groups() -> None:
    """A finished worker leaves with its peers: barrier, destroy every group, wait for gloo's threads to go idle."""
    global _vote_group
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _vote_group = None
    wait_for_idle_gloo_workers()


def leave_at_exit() -> None:
    """Once per process: at interpreter exit, destroy the groups left (no barrier) and wait for idle gloo threads."""
    global _registered
    if not _registered:
        atexit.register(leave_without_peers)
        _registered = True


def leave_without_peers() -> None:
    """Destroy the groups left (no barrier: a peer may be gone) and wait for idle gloo threads, now."""
    global _vote_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _vote_group = None
    wait_for_idle_gloo_workers()


class PeerSetupFailed(SystemExit):
    """Raised on a rank that does not report a failed set-up: the lowest failing rank reports it, this one stops
    without a word (a ``SystemExit``: no traceback; ``code`` is its exit status). ``rank`` is the reporting rank,
    ``failed`` every rank whose set-up failed. A rank whose own set-up failed raises its own error made quiet: an
    instance of both this class and the error's type (``except ValueError`` still catches it, with its message)."""

    def __init__(self, message: str, rank: int, failed: list[int], code: int = 1) -> None:
        super().__init__(message)
        self.code, self.rank, self.failed = code, rank, failed


def _quiet(error: BaseException, rank: int, failed: list[int], code: int) -> PeerSetupFailed:
    """``error`` as a :class:`PeerSetupFailed` that is still an instance of its type, or a plain one where the type
    cannot be mixed in (its instances have their own C layout, e.g. ``OSError``)."""
    try:
        kind = type(f"Quiet{type(error).__name__}", (PeerSetupFailed, type(error)), {"__module__": __name__})
        quiet = BaseException.__new__(kind, *error.args)
        quiet.__dict__.update(error.__dict__)
        quiet.args = error.args
    except TypeError:
        return PeerSetupFailed(f"set-up failed on rank(s) {failed}; rank {rank} reports the error", rank, failed, code)
    quiet.code, quiet.rank, quiet.failed = code, rank, failed
    return quiet.with_traceback(error.__traceback__)


def is_reported_setup_failure(error: BaseException) -> bool:
    """Whether ``error`` is the one :func:`agree_on_setup` had the lowest failing rank raise."""
    return getattr(error, _SETUP_FAILURE, False) is True


def setup_vote_group(timeout: timedelta, quiet_exit_code: Optional[int] = None) -> Optional[dist.ProcessGroup]:
    """The gloo group :func:`agree_on_setup` votes on (``None`` in one process). Collective the first time after each
    ``init_process_group``: call it where every rank passes, right after the processes start. ``quiet_exit_code``: the
    exit status of this process when it stops quietly (1 in the process the user started, 0 in a launched rank), kept
    for later votes."""
    global _vote_group, _quiet_exit_code
    if quiet_exit_code is not None:
        _quiet_exit_code = quiet_exit_code
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _vote_group is None or _vote_group[0] is not world:
        _vote_group = (world, dist.new_group(backend="gloo", timeout=timeout))
    return _vote_group[1]


def agree_on_setup(
    error: Optional[BaseException], group: Optional[dist.ProcessGroup], quiet_exit_code: Optional[int] = None,
    where: str = "HybridParallelStrategy.setup",
) -> None:
    """Every rank, at the end of its set-up: ``error`` is what its set-up raised, or ``None``. Returns where no rank
    failed; else the lowest failing rank raises ``error`` and the others :class:`PeerSetupFailed` (``quiet_exit_code``:
    this process's exit status then; ``None``: the one given to :func:`setup_vote_group`). ``group``:
    :func:`setup_vote_group`'s (``None``: one process, no vote). ``where`` names the step in the messages."""
    if quiet_exit_code is None:
        quiet_exit_code = _quiet_exit_code
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    failed, voted = ([0] if error is not None else []), True
    if group is not None:
        flags = torch.zeros(world, dtype=torch.int32, device="cpu")  # the vote group is gloo's, on the host
        flags[rank] = int(error is not None)
        try:
            dist.all_reduce(flags, group=group)
            failed = [r for r, flag in enumerate(flags.tolist()) if flag]
        except Exception as vote_error:  # a peer is gone: it stopped before the end of its set-up
            if error is None:
                raise RuntimeError(
                    f"{where}: rank {rank} succeeded, but a peer left before the ranks could agree on it (its own"
                    f" output says why): {vote_error}"
                ) from None
            failed, voted = [rank], False
    if not failed:
        return
    if error is None:
        raise PeerSetupFailed(f"{where} failed on rank(s) {failed}; rank {failed[0]} reports the error", failed[0],
                              failed, quiet_exit_code)
    if rank != failed[0]:
        raise _quiet(error, failed[0], failed, quiet_exit_code) from None
    setattr(error, _SETUP_FAILURE, True)
    if world > 1 and voted and hasattr(error, "add_note"):  # Python >= 3.11
        mine = "the other ranks stopped quietly" if failed == [rank] else f"this is rank {rank}'s error, the others stopped quietly"
        error.add_note(f"({where} failed on rank(s) {failed} of {world}; {mine}.)")
    raise error


@contextmanager
def reported_once(where: str) -> Iterator[None]:
    """Run a block on every rank, then vote on it (:func:`agree_on_setup` on :func:`setup_vote_group`'s group, with
    its exit status): an error of the block (an ``Exception`` or DCP's ``CheckpointException``) is raised by the
    lowest failing rank, marked as reported, the other ranks stop quietly. Every rank must enter the block where its
    peers do (an error raised in one rank's block while the others wait in a collective of it waits for the timeout).
    Without a vote group (one process, a strategy that made none) the error is raised as it came. An error already
    reported by an inner vote passes through without another."""
    failure: Optional[BaseException] = None
    try:
        yield
    except (Exception, CheckpointException) as error:
        if is_reported_setup_failure(error):
            raise
        failure = error
    group = _vote_group[1] if _vote_group is not None and _vote_group[0] is dist.group.WORLD else None
    if group is None:
        if failure is not None:
            raise failure
        return
    agree_on_setup(failure, group, where=where)


def raise_once(error: Exception) -> None:
    """Every rank calls it with the same ``error`` (decided alike from a collective): rank 0 raises it, marked as
    the reported failure (a launcher hands it to the caller), every other rank a quiet copy (:class:`PeerSetupFailed`,
    still an instance of the error's type)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        raise _quiet(error, 0, [0], 0) from None
    setattr(error, _SETUP_FAILURE, True)
    raise error


def wait_for_idle_gloo_workers(timeout_s: float = 2.0) -> bool:
    """Sleep (the GIL free) until every gloo worker thread of this process sleeps and has not woken for four switch
    intervals; True when they did within ``timeout_s`` (or there are none), False on timeout."""
    quiet_s = 4 * sys.getswitchinterval()
    deadline = time.monotonic() + timeout_s
    last = _gloo_worker_activity()
    while last and time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = _gloo_worker_activity()
        if now == last and all(state == "S" for state, _ in now.values()):
            return True
        last = now
    return not last


def _gloo_worker_activity() -> dict[str, tuple[str, int]]:
    """``{thread id: (scheduler state, voluntary context switches)}`` of this process's gloo worker threads."""
    activity = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return activity
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_THREAD:
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            activity[tid] = (fields["State"].split()[0], int(fields["voluntary_ctxt_switches"]))
        except (OSError, KeyError, ValueError):
            continue  # the thread ended meanwhile
    return activity
