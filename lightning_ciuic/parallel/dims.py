"""Parallel degrees and the device mesh they define.

Contract: ``ParallelDims(pp, dp, tp, world_size)`` validates that every degree is a positive integer
(``dp`` may be ``"auto"``: whatever is left of the world once ``pp`` and ``tp`` are taken) and that
``pp * dp * tp == world_size``; errors name every factor and say what would work. ``build_mesh`` returns a
3-D ``DeviceMesh`` with the named axes ``("pp", "dp", "tp")``, ``tp`` innermost so tensor-parallel
peers are neighbouring ranks (the same node on a real cluster). Everything else asks this object
``pp_enabled``, ``dp_enabled``, ``tp_enabled`` instead of comparing sizes itself.

No Lightning imports: usable with plain ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("pp", "dp", "tp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline (``pp``), data (``dp``) and tensor (``tp``) parallelism over ``world_size`` ranks."""

    pp: int
    dp: int
    tp: int
    world_size: int

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        tensor_parallel_size: int = 1,
    ) -> "ParallelDims":
        """Validate the degrees and fill in ``data_parallel_size="auto"``."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
        cls.check_degrees(pipeline_parallel_size, data_parallel_size, tensor_parallel_size)
        pp, tp = pipeline_parallel_size, tensor_parallel_size
        model_parallel = pp * tp
        if data_parallel_size == "auto":
            if world_size % model_parallel != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by pipeline_parallel_size * tensor_parallel_size"
                    f" = {pp} * {tp} = {model_parallel}; with {world_size} processes choose pp * tp among"
                    f" {_divisors(world_size)}, or change the number of devices/nodes."
                )
            dp = world_size // model_parallel
        else:
            dp = int(data_parallel_size)
        if pp * dp * tp != world_size:
            fix = (
                f"data_parallel_size={world_size // model_parallel} (or 'auto') would work"
                if world_size % model_parallel == 0
                else f"pp * tp must also divide it (one of {_divisors(world_size)})"
            )
            raise ValueError(
                f"pipeline_parallel_size * data_parallel_size * tensor_parallel_size = {pp} * {dp} * {tp}"
                f" = {pp * dp * tp}, but the world size is {world_size}; the product must equal it: {fix}."
            )
        return cls(pp=pp, dp=dp, tp=tp, world_size=world_size)

    @staticmethod
    def check_degrees(
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        tensor_parallel_size: int = 1,
    ) -> None:
        """Raise ``ValueError`` unless each degree is a positive integer (``dp`` may also be ``"auto"``)."""
        degrees = {
            "pipeline_parallel_size": pipeline_parallel_size,
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
        }
        for name, value in degrees.items():
            if name == "data_parallel_size" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = " or 'auto'" if name == "data_parallel_size" else ""
                raise ValueError(f"{name} must be a positive integer{hint}, got {value!r}.")

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the ``(pp, dp, tp)`` mesh over the initialized default process group (collective call)."""
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp} (world size {self.world_size})"
