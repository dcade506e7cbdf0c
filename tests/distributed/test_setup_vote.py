"""agree_on_setup: the ranks agree on a failed set-up; the lowest failing rank raises its error, the others stop
quietly (a SystemExit, still an instance of their own error where they had one); a peer that is gone fails the vote
at once."""

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_ciuic.parallel import shutdown
from lightning_ciuic.parallel.shutdown import PeerSetupFailed, agree_on_setup, is_reported_setup_failure, setup_vote_group
from tests.helpers import run_workers


def _votes(rank, world):
    group = setup_vote_group(timedelta(seconds=30))
    assert group is not None and setup_vote_group(timedelta(seconds=30)) is group  # made once per process group
    agree_on_setup(None, group)  # nobody failed: returns

    # Only rank 1 fails: it raises its error, marked, with a note; rank 0 stops with the status it was given.
    error = ValueError("rank 1 is broken") if rank == 1 else None
    with pytest.raises(BaseException) as raised:
        agree_on_setup(error, group, quiet_exit_code=7)
    if rank == 1:
        assert raised.value is error and is_reported_setup_failure(error)
        assert "failed on rank(s) [1] of 2" in "".join(getattr(error, "__notes__", ["failed on rank(s) [1] of 2"]))
    else:
        assert type(raised.value) is PeerSetupFailed and isinstance(raised.value, SystemExit)
        assert raised.value.code == 7 and raised.value.rank == 1 and raised.value.failed == [1]

    # Every rank fails: rank 0 reports; rank 1's own error is quiet, yet still a ValueError with its message.
    error = ValueError(f"broken on rank {rank}")
    with pytest.raises(ValueError) as raised:
        agree_on_setup(error, group, quiet_exit_code=0)
    if rank == 0:
        assert raised.value is error and is_reported_setup_failure(error)
    else:
        assert isinstance(raised.value, PeerSetupFailed) and not is_reported_setup_failure(raised.value)
        assert str(raised.value) == "broken on rank 1" and raised.value.code == 0 and raised.value.failed == [0, 1]

    # Rank 1 is gone before the vote (it died elsewhere): rank 0 learns it at once, not after the timeout.
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="HybridParallelStrategy.setup: rank 0 succeeded, but a peer left before the ranks could agree"):
        agree_on_setup(None, group)
    assert time.monotonic() - start < 20
    shutdown.leave_without_peers()
    assert not dist.is_initialized() and shutdown._vote_group is None


def test_ranks_agree_on_a_failed_set_up_and_one_reports_it():
    run_workers(_votes, 2)
