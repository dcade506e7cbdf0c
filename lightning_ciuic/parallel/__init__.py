"""Data, tensor and pipeline parallel building blocks. No Lightning imports."""
