import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is importable in tests and in the processes they spawn
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))


def pytest_report_header(config):
    """Kernels differ between machines: say which set this run's torch picked (and what asked for it)."""
    import torch

    asked = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    return f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY={asked})"
