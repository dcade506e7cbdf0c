"""Steps routed through an FSDP2 root's ``forward``, so the root's hooks run although Lightning never calls it.

Contract: ``through_root(root, method_name, *args, **kwargs)`` calls ``root.<method_name>(*args, **kwargs)`` (a
LightningModule's ``training_step``, ``validation_step``, ...) as if it were ``root.forward``: ``root`` 's forward
pre-hooks run before it and its forward hooks after it, once. ``fully_shard`` applied to a LightningModule registers
its root hooks (gather the root's own parameters, wait for the units' reduce-scatters in backward) on ``forward``,
and Lightning calls the step methods instead. Inside the step, further calls of ``root`` itself (``self(x)``) run
its plain ``forward``: FSDP2 hooks nested in themselves would register the post-backward reduce-scatter twice.
This is Lightning's forward redirection for a module that is its own wrapper.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_ciuic import compat


def through_root(root: nn.Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
    had_own_forward = "forward" in root.__dict__
    original_forward = root.forward

    def step_as_forward(*step_args: Any, **step_kwargs: Any) -> Any:
        if had_own_forward:
            root.forward = original_forward  # type: ignore[method-assign]
        else:
            del root.forward
        with compat.forward_hooks_suspended(root):
            return getattr(root, method_name)(*step_args, **step_kwargs)

    root.forward = step_as_forward  # type: ignore[method-assign]
    try:
        return root(*args, **kwargs)
    finally:
        if root.__dict__.get("forward") is step_as_forward:  # the call failed before the step started
            if had_own_forward:
                root.forward = original_forward  # type: ignore[method-assign]
            else:
                del root.forward
