"""What a pipeline stage's backward passes run in: a whole backward, or a zero-bubble schedule's input pass and then
weight pass of the same micro-batch.

Contract: a stage runs each backward (torch's ``backward_one_chunk``) inside :meth:`BackwardPasses.backward` and each
weight pass (``backward_weight_one_chunk``) inside :meth:`BackwardPasses.weight`.

* Every pass runs on the calling thread (``torch.autograd.set_multithreading_enabled(False)``), as on a CPU: an
  accelerator's backward otherwise runs on autograd's worker thread for its device, where the thread-local state the
  pack sets around a pass (a forward-backward pair's turn, :mod:`~lightning_ciuic.parallel.paired_overlap`) is not
  seen.
* An input pass (``full=False``): FP8 linears leave their weights' gradients to the weight pass
  (:func:`~lightning_ciuic.parallel.fp8.weight_gradients_deferred`), and each checkpointed region is recomputed once
  for the two passes (:class:`~lightning_ciuic.compat.RecomputationShared`): the input pass keeps, of what it
  recomputed, what the weight pass reads (the inputs of the nodes it runs again: a linear's input for its weight's
  gradient), and the weight pass takes it instead of running the region's forward again, as torch's did once per
  weight group. The gradients are the same to the bit; the weight pass no longer holds a recomputed region at once,
  nor computes it (DeepSeek-V3 at pp 4, 4096 tokens: 2.9-3.8 GiB off ranks 1-3's step peaks,
  ``benchmarks/pipeline_memory_timeline.py --max-deferred 1``, 2026-12-07; docs/pipeline.md).

No Lightning imports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_ciuic import compat
from lightning_ciuic.parallel.fp8 import weight_gradients_deferred


class BackwardPasses:
    """One stage's backward passes; what each micro-batch's input pass recomputed, until its weight pass."""

    def __init__(self) -> None:
        compat.share_recomputations()  # before any forward: the regions it checkpoints are shared
        self._recomputations: dict[int, compat.RecomputationShared] = {}

    @contextlib.contextmanager
    def backward(self, microbatch: int, full: bool) -> Iterator[None]:
        if full:
            with torch.autograd.set_multithreading_enabled(False):
                yield
            return
        share = self._recomputations[microbatch] = compat.RecomputationShared()
        with torch.autograd.set_multithreading_enabled(False), weight_gradients_deferred(), \
                compat.param_group_nodes_observed(share.again.update), share.first_call():
            yield

    @contextlib.contextmanager
    def weight(self, microbatch: int) -> Iterator[None]:
        share = self._recomputations.pop(microbatch, None)
        with torch.autograd.set_multithreading_enabled(False), \
                share.second_call() if share is not None else contextlib.nullcontext():
            yield
