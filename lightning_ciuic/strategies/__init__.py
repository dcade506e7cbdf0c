"""Lightning strategies of the pack."""

from lightning_ciuic.strategies.hybrid import HybridParallelStrategy

__all__ = ["HybridParallelStrategy"]
