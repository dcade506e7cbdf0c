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


import pytest  # noqa: E402


@pytest.fixture
def moto_endpoint():
    """An S3-compatible server (moto) on loopback for one test: its ``client_kwargs`` for s3fs. Skipped, saying why,
    without the test extra or when it cannot start."""
    server_module = pytest.importorskip("moto.server", reason="moto[server] (test extra) is not installed")
    pytest.importorskip("s3fs", reason="s3fs (test extra) is not installed")
    from lightning_ciuic.testing.ports import free_port

    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
    except Exception as err:  # noqa: BLE001 - any failure to start is a reason to skip, said aloud
        pytest.skip(f"moto server could not start on loopback: {err}")
    try:
        yield {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment: a variable a run sets in the caller's process (MASTER_PORT, which
    Lightning's spawn launcher sets there) must not change the next test's launch. What a fit must leave unchanged
    is asserted where it matters (tests/integration/test_launchers.py)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
