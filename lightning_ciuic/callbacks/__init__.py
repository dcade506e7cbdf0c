"""Lightning callbacks of the pack: thin glue over the framework-free packages."""

from lightning_ciuic.callbacks.data_balance import DynamicDataBalancer
from lightning_ciuic.callbacks.lr_schedule import WarmupCosineAnnealingLR, WarmupCosineSchedule

__all__ = ["DynamicDataBalancer", "WarmupCosineAnnealingLR", "WarmupCosineSchedule"]
