"""HybridParallelStrategy's step routing: where a step goes, and what runs around it.

Contract (each function takes the strategy):

* :func:`training_step`: the replica's batch check when armed (:mod:`~lightning_ciuic.data.check`), the data-parallel
  engine's step start and the previous synchronization's ``comm/bytes_sent`` / ``comm/sync_time`` logged
  (:func:`before_training_step`), then the step: through the pipeline schedule (:func:`pipelined_training_step`),
  through an FSDP2 root's ``forward`` (:func:`through_root`), or Lightning's own (``plain(*args, **kwargs)``); inside
  :func:`loss_parallel`, its loss whole (:func:`~lightning_ciuic.parallel.tensor.local_loss`).
* :func:`evaluation_step`: ``validation_step``, ``test_step`` and ``predict_step``, through an FSDP2 root's ``forward``
  under the precision plugin's context of that step, or Lightning's own; validation and test inside
  :func:`loss_parallel`, their loss whole; prediction's outputs as the model gives them.
* :func:`backward`: Lightning's backward inside :func:`loss_parallel`, or, pipelined, :func:`pipelined_backward`.
* :func:`loss_parallel`: torch's ``loss_parallel()`` while the model's logits are vocabulary-sharded (sequence
  parallelism's plan), else nothing.
* :func:`pipelined_training_step`: the schedule runs backward inside ``training_step``, but Lightning zeroes
  gradients between ``training_step`` and ``backward``: zero them before instead (on the first micro-step of an
  accumulation), and keep the new ones aside (``strategy._pipeline_grads``) until :func:`pipelined_backward` puts them
  back and runs only Lightning's backward hooks. ``pipeline/bubble`` (the previous step's idle fraction) is logged.
* :func:`clip_grad_by_global_norm`: clipping by norm over the whole model (tensor-parallel shards and pipeline
  stages): what the precision plugin's ``clip_grad_by_norm`` is routed to. :func:`precision_plugin` /
  :func:`set_precision_plugin` are the strategy's precision plugin property: every plugin it holds (the one given, or
  Lightning's default ``Precision()``, kept once made) clips through it.

Lightning is imported here (the strategy's glue).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.fsdp import FSDPModule

from lightning_ciuic import compat
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.grad_norm import clip_grad_norm_
from lightning_ciuic.parallel.tensor import local_loss, loss_parallel_context
from lightning_ciuic.strategies.redirection import through_root as _through_root

if TYPE_CHECKING:
    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy


def sharded_root(strategy: HybridParallelStrategy) -> bool:
    """Whether the LightningModule itself is an FSDP2 root, whose hooks (gathering its own parameters, waiting for
    its units' reduce-scatters) run around ``forward`` only."""
    return isinstance(strategy.model, FSDPModule) and strategy.pipeline is None


def through_root(
    strategy: HybridParallelStrategy, context: Callable[[], Any], method_name: str, *args: Any, **kwargs: Any
) -> Any:
    """Lightning calls ``training_step`` (and the others), not ``forward``: route the step through the root's
    ``forward`` (see :mod:`~lightning_ciuic.strategies.redirection`) so FSDP2's root hooks run, once."""
    with context():
        return _through_root(strategy.lightning_module, method_name, *args, **kwargs)


def loss_parallel(strategy: HybridParallelStrategy) -> contextlib.AbstractContextManager:
    """torch's ``loss_parallel()`` while the model's logits are vocabulary-sharded (sequence parallelism's plan):
    a step's cross-entropy, and its backward, computed from the shards."""
    parallelized = strategy.parallelized
    return loss_parallel_context(parallelized is not None and parallelized.loss_parallel)


def training_step(strategy: HybridParallelStrategy, plain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with loss_parallel(strategy):
        return local_loss(_routed_training_step(strategy, plain, *args, **kwargs))


_STEP_CONTEXTS = {"validation_step": "val_step_context", "test_step": "test_step_context", "predict_step": "predict_step_context"}


def evaluation_step(strategy: HybridParallelStrategy, plain: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """``name`` is ``"validation_step"``, ``"test_step"`` or ``"predict_step"`` (see the module docstring)."""

    def step() -> Any:
        if sharded_root(strategy):
            return through_root(strategy, getattr(strategy.precision_plugin, _STEP_CONTEXTS[name]), name, *args, **kwargs)
        return plain(*args, **kwargs)

    if name == "predict_step":
        return step()
    with loss_parallel(strategy):
        return local_loss(step())


def backward(
    strategy: HybridParallelStrategy, plain: Callable[..., torch.Tensor], closure_loss: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    if strategy.pipeline is not None:
        return pipelined_backward(strategy, closure_loss)
    with loss_parallel(strategy):
        return plain(closure_loss, *args, **kwargs)


def _routed_training_step(strategy: HybridParallelStrategy, plain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if strategy.batch_check.armed:
        strategy.batch_check.run(args[0] if args else kwargs.get("batch"), strategy.parallel_dims, strategy.root_device)
    if strategy.data_parallel is not None:
        before_training_step(strategy, strategy.lightning_module.trainer.global_step)
    if strategy.pipeline is not None:
        return pipelined_training_step(strategy, plain, *args, **kwargs)
    if sharded_root(strategy):
        return through_root(strategy, strategy.precision_plugin.train_step_context, "training_step", *args, **kwargs)
    return plain(*args, **kwargs)


def pipelined_training_step(strategy: HybridParallelStrategy, plain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """See the module docstring. One backward per micro-batch: they accumulate, ``post_backward`` averages them
    over dp."""
    assert strategy.pipeline is not None
    module = strategy.lightning_module
    params = strategy.pipeline.parameters()
    automatic = module.automatic_optimization
    trainer = module.trainer
    if automatic and compat.batch_index(trainer) % trainer.accumulate_grad_batches == 0:
        for p in params:
            p.grad = None
    engine = strategy.data_parallel
    # The schedule's micro-batches accumulate: held by the engine, or by the stages themselves (FSDP2 roots:
    # the engine's no_sync then means accumulation micro-steps only, entered by Lightning)
    with contextlib.nullcontext() if engine is not None and engine.schedule_syncs else strategy.block_backward_sync():
        output = plain(*args, **kwargs)
    if automatic:
        params = strategy.pipeline.parameters()  # afresh: held FSDP2 stages (ZeRO-1/2) show their gathered weights
        strategy._pipeline_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
    module.log("pipeline/bubble", strategy.pipeline.bubble, on_step=True, on_epoch=False)
    return output


def pipelined_backward(strategy: HybridParallelStrategy, closure_loss: torch.Tensor) -> torch.Tensor:
    """The pipeline schedule already ran backward inside ``training_step``: only Lightning's hooks remain."""
    assert strategy.pipeline is not None
    for p, grad in zip(strategy.pipeline.parameters(), strategy._pipeline_grads):
        p.grad = grad
    strategy._pipeline_grads = []
    strategy.pre_backward(closure_loss)
    closure_loss = strategy.precision_plugin.pre_backward(closure_loss, strategy.lightning_module)
    closure_loss = strategy.precision_plugin.post_backward(closure_loss, strategy.lightning_module)
    strategy.post_backward(closure_loss)
    return closure_loss


def before_training_step(strategy: HybridParallelStrategy, global_step: int) -> None:
    """Per step: the engine's step start (compression warm-up, "auto"), and logging of the previous sync."""
    engine = strategy.data_parallel
    assert engine is not None
    for message in engine.before_step(global_step):
        rank_zero_info(message)
    stats, (logged_bytes, logged_seconds) = engine.stats, strategy._logged
    if stats.bytes_sent != logged_bytes or stats.wait_seconds != logged_seconds:
        module = strategy.lightning_module
        module.log("comm/bytes_sent", float(stats.bytes_sent - logged_bytes), on_step=True, on_epoch=False)
        module.log("comm/sync_time", stats.wait_seconds - logged_seconds, on_step=True, on_epoch=False)
        strategy._logged = (stats.bytes_sent, stats.wait_seconds)


def clip_grad_by_global_norm(
    plugin: Precision, strategy: HybridParallelStrategy, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]
) -> None:
    dims, meshes = strategy.parallel_dims, strategy.meshes
    pipeline_group = meshes.mesh(Axis.PP).get_group() if dims is not None and dims.pp_enabled and meshes is not None else None
    clip_grad_norm_(plugin.main_params(optimizer), clip_val, pipeline_group=pipeline_group)


def precision_plugin(strategy: HybridParallelStrategy) -> Precision:
    """The plugin the strategy holds; Lightning's default ``Precision()`` where none was given, kept (and so routed)."""
    plugin = compat.precision_plugin_given(strategy)
    if plugin is None:
        strategy.precision_plugin = plugin = Precision()
    return plugin


def set_precision_plugin(strategy: HybridParallelStrategy, plugin: Optional[Precision]) -> None:
    """Clipping by norm must see the whole model: the plugin's norm clipping is routed through ours."""
    if plugin is not None:
        plugin.clip_grad_by_norm = functools.partial(clip_grad_by_global_norm, plugin, strategy)  # picklable for spawn
    compat.set_precision_plugin(strategy, plugin)
