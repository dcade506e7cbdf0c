"""Lightning callbacks of the pack: thin glue over the framework-free packages."""

from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer
from lightning_ciuic.callbacks.data_balance import DynamicDataBalancer
from lightning_ciuic.callbacks.elastic import ElasticResourceManager, NodePreempted
from lightning_ciuic.callbacks.expert_balance import ExpertLoadBalancer
from lightning_ciuic.callbacks.monitor import CommunicationMonitor
from lightning_ciuic.callbacks.lr_schedule import WarmupCosineAnnealingLR, WarmupCosineSchedule
from lightning_ciuic.callbacks.recovery import QuantumRecovery, SnapshotRecovery

__all__ = [
    "AsyncCheckpointer",
    "CommunicationMonitor",
    "DynamicDataBalancer",
    "ElasticResourceManager",
    "ExpertLoadBalancer",
    "NodePreempted",
    "QuantumRecovery",
    "SnapshotRecovery",
    "WarmupCosineAnnealingLR",
    "WarmupCosineSchedule",
]
