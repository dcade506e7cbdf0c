"""lightning_ciuic: distributed-training plugin pack for PyTorch Lightning.

Importing the package registers the strategy names with Lightning's ``StrategyRegistry``:
``Trainer(strategy="ciuic")`` (processes started like ``DDPStrategy``, one script run per rank) and
``Trainer(strategy="ciuic_spawn")`` (multiprocessing spawn: notebooks, tests).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer
from lightning_ciuic.callbacks.data_balance import DynamicDataBalancer
from lightning_ciuic.callbacks.elastic import ElasticResourceManager, NodePreempted
from lightning_ciuic.callbacks.monitor import CommunicationMonitor
from lightning_ciuic.callbacks.lr_schedule import WarmupCosineAnnealingLR, WarmupCosineSchedule, warmup_cosine_lr
from lightning_ciuic.callbacks.recovery import QuantumRecovery, SnapshotRecovery
from lightning_ciuic.comm.compression import GradientCompression
from lightning_ciuic.comm.grad_sync import GradientSynchronizer, GradientSyncTimeoutError
from lightning_ciuic.comm.hooks import GradientQuantizer, register_compression_hook
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.plugins.checkpoint_io import ChunkedCheckpointIO
from lightning_ciuic.parallel.tensor import apply_tensor_parallel
from lightning_ciuic.strategies.hybrid import HybridParallelStrategy
from lightning_ciuic.strategies.pipelining import PipelineModule

# Seed names (see docs/seed_guide.md): the seed's engine and optimizer wrapper are this strategy's arguments.
HybridParallelEngine = HybridParallelStrategy
GradientSyncOptimizer = HybridParallelStrategy

__all__ = [
    "AsyncCheckpointer",
    "ChunkedCheckpointIO",
    "CommunicationMonitor",
    "DynamicDataBalancer",
    "ElasticResourceManager",
    "GradientCompression",
    "GradientQuantizer",
    "GradientSyncOptimizer",
    "GradientSyncTimeoutError",
    "GradientSynchronizer",
    "HybridParallelEngine",
    "HybridParallelStrategy",
    "NodePreempted",
    "ParallelDims",
    "PipelineModule",
    "QuantumRecovery",
    "SnapshotRecovery",
    "WarmupCosineAnnealingLR",
    "WarmupCosineSchedule",
    "apply_tensor_parallel",
    "register_compression_hook",
    "warmup_cosine_lr",
]

_REGISTERED = {
    "ciuic": ({}, "Hybrid pipeline x tensor x data parallel (processes started per rank, like DDPStrategy)"),
    "ciuic_spawn": ({"start_method": "spawn"}, "HybridParallelStrategy started with multiprocessing spawn"),
    "ciuic_fork": ({"start_method": "fork"}, "HybridParallelStrategy started with multiprocessing fork"),
}
for _name, (_kwargs, _description) in _REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, HybridParallelStrategy, description=_description, **_kwargs)
__version__ = "0.1.0"
