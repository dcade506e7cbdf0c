"""Compressed gradient averaging: the reducer the strategy plugs into :class:`GradientSynchronizer`.

Contract of ``GradientCompression(mode, ...)``, called per bucket as ``reducer(key, buffer, shapes, group)``:

* ``mode``: ``"none"`` (float32), ``"fp16"``/``"bf16"`` (16-bit casts), ``"int8"``/``"nf4"`` (block-wise
  quantization through :func:`quantized_allreduce_`), ``"topk"`` (``compression_ratio`` of the values with
  their indices), ``"powersgd"`` (rank ``powersgd_rank``). ``"auto"`` is resolved by
  :class:`~lightning_ciuic.comm.auto.AutoCompression` into one of the dense modes and set with
  :meth:`set_mode`.
* ``algorithm`` for ``none``/``fp16``/``bf16``: ``"ring"`` or ``"tree"`` run our point-to-point
  implementations; ``"native"`` (what ``"auto"`` resolves to) is the backend's own all-reduce. Quantized,
  top-k and PowerSGD modes have their own collectives: ``"ring"``/``"tree"`` with them (or with mode
  ``"auto"``, which may choose int8 or nf4) is an error.
* ``error_feedback`` keeps, per bucket, what compression dropped and adds it to the next step's gradient:
  ``None`` (default) for ``int8``, ``nf4``, ``topk`` and ``powersgd`` but not the 16-bit casts, whose error
  is 2^-11 (fp16) / 2^-8 (bf16) of each value (:func:`feedback_applies`); ``True`` for every lossy mode;
  ``False`` for none. Residuals and PowerSGD's warm-start ``Q`` are in :meth:`state_dict`.
* For the first ``warmup_steps`` optimizer steps (``set_step``) buckets go uncompressed.
* The reduction runs on one background thread (collectives in bucket order, overlapping backward);
  the returned object's ``wait(timeout)`` returns the bytes this rank sent. With the backend's algorithm,
  uncompressed buckets (warm-up steps, or ``"auto"`` choosing ``none``) take the synchronizer's own async
  path instead, so they cost exactly what ``communication_compression="none"`` costs, and 16-bit casts
  without error feedback are the backend's async all-reduce of the cast bucket (what torch's
  ``fp16_compress_hook`` does): no thread, one cast each way.

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, get_args

import torch
import torch.distributed as dist

from lightning_ciuic.wire.codecs import ErrorFeedback, FullPrecision, TopK, dense_codec
from lightning_ciuic.comm.collectives import (
    native_allreduce_,
    quantized_allreduce_,
    ring_allreduce_,
    topk_allreduce_,
    tree_allreduce_,
)
from lightning_ciuic.comm.grad_sync import PendingReduction, mean_all_reduce
from lightning_ciuic.comm.powersgd import PowerSGD
from lightning_ciuic.validation import check_int

CompressionMode = Literal["none", "fp16", "bf16", "int8", "nf4", "topk", "powersgd", "auto"]
AllReduceAlgorithm = Literal["auto", "ring", "tree"]
COMPRESSION_MODES: tuple[str, ...] = get_args(CompressionMode)
ALGORITHMS: tuple[str, ...] = get_args(AllReduceAlgorithm)
RING_TREE_MODES = ("none", "fp16", "bf16")  # the modes our ring and tree all-reduces carry
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def feedback_applies(error_feedback: bool | None, mode: str) -> bool:
    """Whether ``mode``'s buckets keep error feedback under the ``error_feedback`` setting (module docstring):
    a 16-bit cast only when asked for (``True``), the other lossy modes unless turned off (``False``)."""
    if mode == "none":
        return False
    return error_feedback is True if mode in _HALF else error_feedback is not False


class _CastReduction:
    """A bucket's 16-bit all-reduce in flight on the backend; ``wait`` writes the average back into the bucket."""

    def __init__(self, work: dist.Work, wire: torch.Tensor, buffer: torch.Tensor, nbytes: int) -> None:
        self.work, self.wire, self.buffer, self.nbytes = work, wire, buffer, nbytes

    def wait(self, timeout: timedelta) -> int:
        self.work.wait(timeout)
        self.buffer.copy_(self.wire)
        return self.nbytes

    def done(self) -> bool:
        return self.work.is_completed()


def cast_mean_all_reduce(buffer: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype) -> PendingReduction:
    """Average ``buffer`` over ``group`` in ``dtype`` with the backend's async all-reduce: divide in the bucket's
    precision, cast once, all-reduce SUM, cast back on ``wait`` (bytes counted as a ring all-reduce)."""
    size = dist.get_world_size(group)
    wire = buffer.div_(size).to(dtype)
    work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _CastReduction(work, wire, buffer, 2 * (size - 1) * wire.numel() * wire.element_size() // size)


class _FutureReduction:
    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self, timeout: timedelta) -> int:
        try:
            return self.future.result(timeout=timeout.total_seconds())
        except FutureTimeout as err:
            raise RuntimeError("compressed all-reduce timed out") from err

    def done(self) -> bool:
        return self.future.done()


def validate_compression(mode: str, compression_ratio: float, powersgd_rank: int, warmup_steps: int, algorithm: str) -> None:
    """Raise ``ValueError`` naming the bad argument and the valid choices."""
    if mode not in COMPRESSION_MODES:
        raise ValueError(f"communication_compression={mode!r} is not a mode; use one of {COMPRESSION_MODES}.")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"allreduce_algorithm={algorithm!r}; use one of {ALGORITHMS}.")
    if algorithm != "auto" and mode not in RING_TREE_MODES:
        raise ValueError(
            f"allreduce_algorithm={algorithm!r} applies to communication_compression in {RING_TREE_MODES} only;"
            f" {mode!r} runs its own collective ({'it may choose int8 or nf4' if mode == 'auto' else 'quantized all-to-all, sparse all-gather or low-rank all-reduces'})."
            f" Use allreduce_algorithm='auto' with {mode!r}, or one of {RING_TREE_MODES} with {algorithm!r}."
        )
    TopK(compression_ratio)
    PowerSGD(powersgd_rank)
    check_int("compression_warmup_steps", warmup_steps, minimum=0)


@dataclass(frozen=True)
class CompressionConfig:
    """How data-parallel gradients travel; validated on construction (every error names what was given and
    what would work). The fields are ``HybridParallelStrategy``'s arguments of the same meaning:

    * ``mode``: ``communication_compression`` (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"nf4"``,
      ``"topk"``, ``"powersgd"``, ``"auto"``);
    * ``compression_ratio``: the fraction ``"topk"`` keeps; ``powersgd_rank``: PowerSGD's rank;
    * ``error_feedback``: carry what a lossy mode dropped into the next step's gradient (``None``: for every
      lossy mode but the 16-bit casts; see :func:`feedback_applies`);
    * ``warmup_steps``: ``compression_warmup_steps``, optimizer steps synchronized uncompressed first;
    * ``algorithm``: ``allreduce_algorithm``, ``"auto"`` (the backend's) or our ``"ring"``/``"tree"``;
    * ``auto_recheck_steps``: how often ``"auto"`` decides again.
    """

    mode: CompressionMode = "none"
    compression_ratio: float = 0.01
    powersgd_rank: int = 4
    error_feedback: bool | None = None
    warmup_steps: int = 0
    algorithm: AllReduceAlgorithm = "auto"
    auto_recheck_steps: int = 500

    def __post_init__(self) -> None:
        validate_compression(self.mode, self.compression_ratio, self.powersgd_rank, self.warmup_steps, self.algorithm)
        check_int("auto_recheck_steps", self.auto_recheck_steps)

    def feedback_for(self, mode: str) -> bool:
        """Whether ``mode`` keeps error feedback under this config."""
        return feedback_applies(self.error_feedback, mode)

    @property
    def exact_mean(self) -> bool:
        """Whether buckets take the backend's exact mean with nothing in between (no reducer needed)."""
        return self.mode == "none" and self.algorithm == "auto"


Collective = Callable[[str, torch.Tensor, list[torch.Size], dist.ProcessGroup], tuple[torch.Tensor, int]]


class GradientCompression:
    """Reducer for :class:`~lightning_ciuic.comm.grad_sync.GradientSynchronizer` (see module docstring)."""

    @classmethod
    def from_config(cls, config: CompressionConfig) -> "GradientCompression":
        return cls(
            config.mode, config.compression_ratio, config.powersgd_rank, config.error_feedback, config.warmup_steps,
            config.algorithm,
        )

    def __init__(
        self,
        mode: CompressionMode = "none",
        compression_ratio: float = 0.01,
        powersgd_rank: int = 4,
        error_feedback: bool | None = None,
        warmup_steps: int = 0,
        algorithm: AllReduceAlgorithm = "auto",
    ) -> None:
        validate_compression(mode, compression_ratio, powersgd_rank, warmup_steps, algorithm)
        self.requested_mode = mode
        self.mode = "none" if mode == "auto" else mode
        self.algorithm = "native" if algorithm == "auto" else algorithm
        self.feedback_setting = error_feedback
        self.error_feedback = ErrorFeedback() if error_feedback is not False else None
        self.warmup_steps = warmup_steps
        self.topk = TopK(compression_ratio)
        self.powersgd = PowerSGD(powersgd_rank)
        self.step = 0
        self._collectives: dict[tuple[str, str], Collective] = {}  # chosen once per (mode, algorithm)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ciuic-grad-sync")

    def set_mode(self, mode: str, algorithm: str = "native") -> None:
        """Switch the active mode/algorithm (used by ``"auto"``); takes effect at the next bucket."""
        self.mode, self.algorithm = mode, algorithm

    def set_step(self, step: int) -> None:
        self.step = step

    @property
    def active_mode(self) -> str:
        return "none" if self.step < self.warmup_steps else self.mode

    def __call__(self, key: str, buffer: torch.Tensor, shapes: list[torch.Size], group: dist.ProcessGroup) -> PendingReduction:
        mode = self.active_mode
        if self.algorithm == "native":  # the backend's async paths, no thread
            if mode == "none":
                return mean_all_reduce(key, buffer, shapes, group)
            if mode in _HALF and not feedback_applies(self.feedback_setting, mode):
                return cast_mean_all_reduce(buffer, group, _HALF[mode])
        return _FutureReduction(self.submit(key, buffer, shapes, group))

    def submit(self, key: str, buffer: torch.Tensor, shapes: list[torch.Size], group: dist.ProcessGroup) -> Future:
        """Queue the reduction of one bucket on the worker thread; the future's result is the bytes sent."""
        mode = self.active_mode
        return self._executor.submit(self.reduce_, key, buffer, shapes, group, mode, self._collective(mode, self.algorithm))

    def _collective(self, mode: str, algorithm: str) -> Collective:
        """The collective and codec of ``(mode, algorithm)``, chosen once and kept."""
        chosen = self._collectives.get((mode, algorithm))
        if chosen is not None:
            return chosen
        if mode == "powersgd":
            def chosen(key, work, shapes, group):  # averages ``work`` in place: what was sent is the result
                return work, self.powersgd.allreduce_(key, work, shapes, group)
        elif mode == "topk":
            chosen = lambda key, work, shapes, group: topk_allreduce_(work, group, self.topk)  # noqa: E731
        elif mode in ("int8", "nf4"):
            codec, feedback = dense_codec(mode), feedback_applies(self.feedback_setting, mode)
            chosen = lambda key, work, shapes, group: quantized_allreduce_(work, group, codec, feedback)  # noqa: E731
        elif algorithm in ("ring", "tree"):
            collective = ring_allreduce_ if algorithm == "ring" else tree_allreduce_
            if mode == "none":  # uncompressed: the bucket's own dtype on the wire (float64 stays exact)
                chosen = lambda key, work, shapes, group: collective(work, group, FullPrecision(work.dtype))  # noqa: E731
            else:
                codec = dense_codec(mode)
                chosen = lambda key, work, shapes, group: collective(work, group, codec)  # noqa: E731
        else:
            chosen = lambda key, work, shapes, group: native_allreduce_(work, group, _HALF.get(mode))  # noqa: E731
        self._collectives[(mode, algorithm)] = chosen
        return chosen

    def reduce_(
        self, key: str, buffer: torch.Tensor, shapes: list[torch.Size], group: dist.ProcessGroup, mode: str, collective: Collective
    ) -> int:
        """Average ``buffer`` in place with ``collective`` (``mode``'s); returns bytes sent. Runs on the worker thread."""
        feedback = self.error_feedback if feedback_applies(self.feedback_setting, mode) else None
        if feedback is not None:
            feedback.compensate_(key, buffer)
        transmitted, sent = collective(key, buffer, shapes, group)
        if feedback is not None:
            feedback.settle(key, transmitted)
        return sent

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors, flat names: ``residual.<bucket>`` and ``powersgd_q.<bucket>.<i>``."""
        state = {f"residual.{key}": value for key, value in (self.error_feedback.state_dict() if self.error_feedback else {}).items()}
        for key, qs in self.powersgd.state_dict().items():
            state.update({f"powersgd_q.{key}.{i}": q for i, q in enumerate(qs)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.error_feedback is not None:
            self.error_feedback.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("residual.")})
        qs: dict[str, list[torch.Tensor]] = {}
        for name in sorted((k for k in state if k.startswith("powersgd_q.")), key=lambda k: int(k.rsplit(".", 1)[1])):
            qs.setdefault(name.split(".")[1], []).append(state[name])
        self.powersgd.load_state_dict(qs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
