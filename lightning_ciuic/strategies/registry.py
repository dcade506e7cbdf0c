"""The strategy names ``Trainer(strategy=...)`` accepts, registered with Lightning's ``StrategyRegistry``.

``"ciuic"`` (one script run per rank, like ``DDPStrategy``), ``"ciuic_spawn"``, ``"ciuic_fork"`` and
``"ciuic_forkserver"`` (multiprocessing: notebooks, tests) build :class:`~lightning_ciuic.strategies.hybrid.HybridParallelStrategy`
when Lightning asks for them, so registering imports only Lightning's registry. Importing ``lightning_ciuic``
calls :func:`register` where Lightning is installed.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

STRATEGY_NAMES = {
    "ciuic": ({}, "Hybrid pipeline x tensor x data parallel (processes started per rank, like DDPStrategy)"),
    "ciuic_spawn": ({"start_method": "spawn"}, "HybridParallelStrategy started with multiprocessing spawn"),
    "ciuic_fork": ({"start_method": "fork"}, "HybridParallelStrategy started with multiprocessing fork"),
    "ciuic_forkserver": (
        {"start_method": "forkserver"}, "HybridParallelStrategy forked from a server with torch and Lightning imported"
    ),
}


def hybrid_parallel_strategy(**kwargs: Any) -> Any:
    """``HybridParallelStrategy(**kwargs)``, imported when Lightning resolves a registered name."""
    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy

    return HybridParallelStrategy(**kwargs)


def register() -> None:
    for name, (kwargs, description) in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, hybrid_parallel_strategy, description=description, **kwargs)
