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
failure), to run at interpreter exit while Python is still whole. Linux (``/proc``); elsewhere the wait is skipped.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import torch.distributed as dist

GLOO_WORKER_THREAD = "pt_gloo_runloop"
_registered = False


def leave_process_groups() -> None:
    """A finished worker leaves with its peers: barrier, destroy every group, wait for gloo's threads to go idle."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    wait_for_idle_gloo_workers()


def leave_at_exit() -> None:
    """Once per process: at interpreter exit, destroy the groups left (no barrier) and wait for idle gloo threads."""
    global _registered
    if not _registered:
        atexit.register(_leave_without_peers)
        _registered = True


def _leave_without_peers() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    wait_for_idle_gloo_workers()


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
