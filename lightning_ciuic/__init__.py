"""lightning_ciuic: distributed-training plugin pack for PyTorch Lightning.

Public names load on first use (module ``__getattr__``), so the framework-free floors (``parallel``, ``comm``,
``checkpoint``, ``advice``) import without Lightning. Where Lightning is installed, importing the package
registers the strategy names with Lightning's ``StrategyRegistry``: ``Trainer(strategy="ciuic")`` (processes
started like ``DDPStrategy``, one script run per rank) and ``Trainer(strategy="ciuic_spawn")`` (multiprocessing
spawn: notebooks, tests).

Seed names (see docs/seed_guide.md) are aliases, not the API: ``HybridParallelEngine`` and
``GradientSyncOptimizer`` are :class:`HybridParallelStrategy` (the seed's engine and optimizer wrapper are its
arguments); ``QuantumRecovery`` is :class:`SnapshotRecovery`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "AsyncCheckpointer": ("lightning_ciuic.callbacks.async_checkpoint", "AsyncCheckpointer"),
    "ChunkedCheckpointIO": ("lightning_ciuic.plugins.checkpoint_io", "ChunkedCheckpointIO"),
    "CommunicationMonitor": ("lightning_ciuic.callbacks.monitor", "CommunicationMonitor"),
    "CompressionConfig": ("lightning_ciuic.comm.compression", "CompressionConfig"),
    "DataParallel": ("lightning_ciuic.comm.data_parallel", "DataParallel"),
    "DiLoCo": ("lightning_ciuic.comm.diloco", "DiLoCo"),
    "DynamicDataBalancer": ("lightning_ciuic.callbacks.data_balance", "DynamicDataBalancer"),
    "ElasticResourceManager": ("lightning_ciuic.callbacks.elastic", "ElasticResourceManager"),
    "ExpertLoadBalancer": ("lightning_ciuic.callbacks.expert_balance", "ExpertLoadBalancer"),
    "GradientCompression": ("lightning_ciuic.comm.compression", "GradientCompression"),
    "GradientQuantizer": ("lightning_ciuic.comm.hooks", "GradientQuantizer"),
    "GradientSyncOptimizer": ("lightning_ciuic.strategies.hybrid", "HybridParallelStrategy"),  # seed alias
    "GradientSyncTimeoutError": ("lightning_ciuic.comm.grad_sync", "GradientSyncTimeoutError"),
    "GradientSynchronizer": ("lightning_ciuic.comm.grad_sync", "GradientSynchronizer"),
    "HybridParallelEngine": ("lightning_ciuic.strategies.hybrid", "HybridParallelStrategy"),  # seed alias
    "HybridParallelStrategy": ("lightning_ciuic.strategies.hybrid", "HybridParallelStrategy"),
    "NodePreempted": ("lightning_ciuic.callbacks.elastic", "NodePreempted"),
    "ParallelContext": ("lightning_ciuic.strategies.context", "ParallelContext"),
    "ParallelDims": ("lightning_ciuic.parallel.dims", "ParallelDims"),
    "PipelineModule": ("lightning_ciuic.parallel.pipeline_module", "PipelineModule"),
    "QuantumRecovery": ("lightning_ciuic.callbacks.recovery", "QuantumRecovery"),  # seed alias
    "Replicated": ("lightning_ciuic.comm.data_parallel", "Replicated"),
    "SnapshotRecovery": ("lightning_ciuic.callbacks.recovery", "SnapshotRecovery"),
    "WarmupCosineAnnealingLR": ("lightning_ciuic.callbacks.lr_schedule", "WarmupCosineAnnealingLR"),
    "WarmupCosineSchedule": ("lightning_ciuic.callbacks.lr_schedule", "WarmupCosineSchedule"),
    "apply_tensor_parallel": ("lightning_ciuic.parallel.tensor", "apply_tensor_parallel"),
    "data_parallel_world": ("lightning_ciuic.data.world", "data_parallel_world"),
    "parallel_context": ("lightning_ciuic.strategies.context", "parallel_context"),
    "plan": ("lightning_ciuic.planner", "plan"),
    "register_compression_hook": ("lightning_ciuic.comm.hooks", "register_compression_hook"),
    "warmup_cosine_lr": ("lightning_ciuic.callbacks.lr_schedule", "warmup_cosine_lr"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_ciuic' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next access does not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _register_strategy_names() -> None:
    try:
        from lightning_ciuic.strategies.registry import register
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "lightning":
            raise
        return  # no Lightning here: the framework-free floors still import
    register()


_register_strategy_names()
