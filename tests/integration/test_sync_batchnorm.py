"""``Trainer(sync_batchnorm=True)`` under the strategy is never ignored: batch norm layers become SyncBatchNorm over
the data-parallel replicas (on GPUs: tests/gpu), and a CPU run, where torch's SyncBatchNorm cannot run, is refused
before any process starts."""

import pytest
from lightning.pytorch import Trainer

from lightning_ciuic import HybridParallelStrategy


def test_sync_batchnorm_on_the_cpu_is_refused_with_what_would_work():
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) converts batch norm layers to torch's SyncBatchNorm, which runs on CUDA .* leave sync_batchnorm off"):
        Trainer(strategy=HybridParallelStrategy(), accelerator="cpu", devices=2, sync_batchnorm=True)
