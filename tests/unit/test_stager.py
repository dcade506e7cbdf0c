"""The staging copy of ``ChunkedCheckpointIO``: private host buffers, reused between saves, never aliasing the
training state (the GPU path, pinned buffers on a side stream, is in tests/gpu/test_gpu_smoke.py)."""

import torch

from lightning_ciuic.checkpoint.storage import PAGE
from lightning_ciuic.plugins.checkpoint_io import Stager


def test_staged_copies_are_private_reused_page_aligned_and_keep_the_structure():
    state = {"model": {"w": torch.randn(64, 32), "step": 3}, "optimizer": [torch.arange(10), ("tag", torch.ones(2))]}
    stage = Stager()
    first = stage(state)
    stage.synchronize()  # nothing to wait for on the CPU
    assert first["model"]["step"] == 3 and first["optimizer"][1][0] == "tag" and type(first["optimizer"][1]) is tuple
    assert torch.equal(first["model"]["w"], state["model"]["w"]) and torch.equal(first["optimizer"][0], state["optimizer"][0])
    assert first["model"]["w"].data_ptr() % PAGE == 0  # local storage can write it with O_DIRECT
    before = state["model"]["w"].clone()
    state["model"]["w"].add_(1.0)  # training goes on after the stall
    assert torch.equal(first["model"]["w"], before)
    second = stage(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # the buffer is reused, not reallocated
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    state["model"]["w"] = torch.randn(8, 8)  # a tensor that changed shape gets a new buffer
    assert stage(state)["model"]["w"].shape == (8, 8)
