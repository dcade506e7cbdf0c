"""The console script's progress bar counts the batches the run takes when ``max_steps`` ends it inside an epoch."""

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ciuic.progress import MaxStepsBound, bound_to_max_steps


class Totals(TQDMProgressBar):
    """A user's own bar: left as it is."""


@pytest.mark.parametrize(("max_steps", "accumulate", "expected"), [(5, 1, 5), (5, 2, 10), (-1, 1, 20)])
def test_the_epoch_total_is_what_max_steps_leaves(tmp_path, max_steps, accumulate, expected):
    bar = TQDMProgressBar()
    bound_to_max_steps(bar)
    assert isinstance(bar, MaxStepsBound) and isinstance(bar, TQDMProgressBar)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=1, limit_train_batches=20, limit_val_batches=0,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, callbacks=[bar],
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    assert bar.train_progress_bar.total == expected  # Lightning's own bar: 20 (the epoch) whatever max_steps


def test_only_lightnings_own_bars_are_bound():
    rich, own = RichProgressBar(), Totals()
    bound_to_max_steps(rich), bound_to_max_steps(own), bound_to_max_steps(None)
    assert isinstance(rich, MaxStepsBound) and isinstance(rich, RichProgressBar)
    assert type(own) is Totals
