"""Checkpoint formats and storage. No Lightning imports."""
