"""The main job's model, data and configs (see examples/README.md)."""
