"""AsyncCheckpointer: asynchronous, incremental, zstd-compressed, sharded checkpoints on any fsspec storage.

Contract: :class:`AsyncCheckpointer` (seed trick 5) installs a
:class:`~lightning_ciuic.plugins.checkpoint_io.ChunkedCheckpointIO` on the strategy at set-up (so
``trainer.save_checkpoint`` and ``Trainer.fit(ckpt_path=...)`` use the same format), checks that the storage is
writable and removes what a dead save left behind. It saves every ``save_interval`` seconds and/or every
``every_n_train_steps`` optimizer steps (the decision is agreed by all ranks: due when any rank's clock says
so), postpones a due save to the next step while the previous one is still being written (training never
waits for storage), keeps ``max_keep`` checkpoints, saves once more at the end of training, and makes
``ckpt_path="last"`` resolve to the newest committed checkpoint (it is a ``ModelCheckpoint`` for Lightning's
resolution of ``"last"``; none of ``ModelCheckpoint``'s own saving runs). When ``fit`` fails (anything but
Ctrl-C) the save in flight is abandoned before its next chunk and never commits: a peer that died cannot finish
its part, and the restart should not wait for an upload.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ciuic.comm.vote import StepVote
from lightning_ciuic.parallel.shutdown import reported_once
from lightning_ciuic.plugins.checkpoint_io import ChunkedCheckpointIO, Compression
from lightning_ciuic.strategies.context import batch_end_vote, step_vote
from lightning_ciuic.validation import check_int

_VOTE = "AsyncCheckpointer"  # its slot in the per-step vote


class AsyncCheckpointer(ModelCheckpoint):
    """Asynchronous incremental checkpoints every ``save_interval`` seconds and/or ``every_n_train_steps``.

    Args:
        dirpath: any fsspec URL (local path, ``file://``, ``memory://``, ``s3://`` with s3fs, ...).
        save_interval: seconds between saves (the seed's 30 minutes); ``None`` or 0 turns time-based saves off.
        every_n_train_steps: optimizer steps between saves (``None``: off).
        incremental: reuse chunks unchanged since an earlier checkpoint (``False`` rewrites everything).
        max_keep: checkpoints kept (>= 1); older ones and the chunks only they use are deleted.
        compression: ``"zstd"`` or ``"none"``; ``compression_level`` 1..22.
        storage_options: passed to fsspec (credentials, endpoint, ...).
        save_on_train_end: save once more when training ends.
    """

    def __init__(
        self,
        dirpath: str,
        save_interval: Optional[float] = 1800.0,
        every_n_train_steps: Optional[int] = None,
        incremental: bool = True,
        max_keep: int = 5,
        compression: Compression = "zstd",
        compression_level: int = 3,
        storage_options: Optional[dict[str, Any]] = None,
        save_on_train_end: bool = True,
    ) -> None:
        if save_interval is not None and save_interval < 0:
            raise ValueError(f"save_interval must be >= 0 seconds (0 or None: off), got {save_interval!r}.")
        check_int("every_n_train_steps", every_n_train_steps, allowed=(None,))
        check_int("max_keep", max_keep, note="checkpoints kept")
        super().__init__(dirpath=None, save_top_k=0, save_last=False)
        self.io = ChunkedCheckpointIO(dirpath, max_keep, compression, compression_level, incremental, storage_options)
        self.url = str(dirpath)
        self.save_interval = float(save_interval or 0.0)
        self.every_n = every_n_train_steps
        self.save_on_train_end = save_on_train_end
        self.saves, self.postponed, self.stalls = 0, 0, []
        self._last_save_time = 0.0
        self._last_saved_step = -1
        self._vote: Optional[StepVote] = None

    @property
    @override
    def state_key(self) -> str:
        return f"AsyncCheckpointer{{'url': {self.url!r}}}"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.strategy.checkpoint_io is not self.io:
            trainer.strategy.checkpoint_io = self.io
        with reported_once("AsyncCheckpointer.setup"):  # rank 0's storage error is said once, the others stop quietly
            if trainer.is_global_zero:
                self.io.store.storage.check_writable()
                removed = self.io.catalog.sweep_orphans()
                if removed:
                    rank_zero_info(f"AsyncCheckpointer: removed {removed} chunks of saves that never committed.")
        trainer.strategy.barrier("async-checkpointer-setup")
        self._vote = step_vote(trainer)
        self._vote.register(_VOTE, 2, self._local_flags)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._vote is not None:
            self._vote.release(_VOTE)
            self._vote = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_save_time = time.monotonic()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_saved_step:
            return
        by_steps = self.every_n is not None and step % self.every_n == 0
        if by_steps or self.save_interval > 0:  # decided together: every rank must take part in a save
            by_time, busy = batch_end_vote(trainer, _VOTE, pl_module, outputs, batch_idx)
            if by_steps or by_time > 0:
                if busy == 0:
                    self._save(trainer)
                else:
                    self.postponed += 1

    def _local_flags(self, trainer: Trainer, pl_module: LightningModule, outputs: Any) -> tuple[bool, bool]:
        """This rank's vote: (its clock says a save is due, its previous save is still being written)."""
        return self.save_interval > 0 and time.monotonic() - self._last_save_time >= self.save_interval, self.io.busy

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass  # saves are step- and time-driven

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_on_train_end and trainer.global_step != self._last_saved_step:
            self._save(trainer)
        self.io.wait()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, KeyboardInterrupt):  # Ctrl-C: every rank is alive, the save can still commit
            self.io.abandon()

    def _save(self, trainer: Trainer) -> None:
        name = self._unused_name(trainer, f"epoch={trainer.current_epoch}-step={trainer.global_step}")
        trainer.save_checkpoint(name, weights_only=False)  # the whole training state (and no log line per rank)
        self.stalls.append(self.io.last_stall_seconds)
        self.saves += 1
        self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()

    def _unused_name(self, trainer: Trainer, name: str) -> str:
        """Collective: ``name``, or ``name-v1``, ``name-v2``, ... where a committed checkpoint (an earlier run's in
        the same directory) has it already, as ``ModelCheckpoint`` versions its files: nothing is replaced."""
        if trainer.is_global_zero:
            taken, free = {manifest.name for manifest in self.io.catalog.manifests()}, name
            for version in itertools.count(1):
                if free not in taken:
                    break
                free = f"{name}-v{version}"
            if free != name:
                rank_zero_warn(
                    f"AsyncCheckpointer: {self.url} already holds a checkpoint {name} (an earlier run's); this one is"
                    f" saved as {free}, nothing is replaced. Give each run its own dirpath to keep their names apart."
                )
            name = free
        return trainer.strategy.broadcast(name)

    def latest_checkpoint(self) -> Optional[str]:
        """The URL of the newest committed checkpoint, or ``None``."""
        return self.io.latest_url if self.io.catalog.manifests() else None

    @override
    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        latest = self.latest_checkpoint()
        if latest is None:
            return set()
        # Lightning checks the path with fsspec's default options: a store that needs storage_options is named by a
        # process-local marker instead (ChunkedCheckpointIO.mark_latest); a plain path keeps its own name in the logs
        return {self.io.mark_latest() if self.io.storage_options else latest}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"url": self.url, "saves": self.saves}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saves = int(state_dict.get("saves", 0))

