"""Lightning plugins of the pack."""

from lightning_ciuic.plugins.checkpoint_io import ChunkedCheckpointIO

__all__ = ["ChunkedCheckpointIO"]
