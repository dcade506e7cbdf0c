"""The framework-free floors (wire/, parallel/, comm/, checkpoint/, data/ and the advisor) import with Lightning blocked,
the floors stack one way (wire/ below parallel/ below comm/; callbacks/ above strategies/), and the package root loads
its public names lazily while registering the strategy names where Lightning is installed."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_ciuic

FLOORS = ("wire", "parallel", "comm", "checkpoint", "data", "advice")
SHARED = ("lightning_ciuic.validation", "lightning_ciuic.tensors")
PACKAGE = Path(lightning_ciuic.__file__).parent


def floor_modules() -> list[str]:
    paths = [path for floor in FLOORS for path in sorted((PACKAGE / floor).rglob("*.py"))]
    names = [".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts) for path in paths]
    return [name.removesuffix(".__init__") for name in names] + list(SHARED)


def test_every_floor_module_imports_with_lightning_blocked():
    modules = floor_modules()
    assert len(modules) > 15
    code = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None  # any import of them fails\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
        "assert not [m for m in sys.modules if m.startswith('lightning.')], 'Lightning got imported'\n"
        "assert 'lightning_ciuic.config' not in sys.modules, 'a floor imports the config: the arrow runs from it down'\n"
        "import lightning_ciuic\n"
        "assert lightning_ciuic.ParallelDims.__name__ == 'ParallelDims'  # public names of the floors load lazily\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_parallel_loads_nothing_of_comm_and_wire_nothing_above_it():
    """parallel/ is below comm/ (comm/ reduces a parallelized model's gradients): importing every module of parallel/
    and wire/ loads no comm/ module (nor wire/ any parallel/ one), type-only imports aside."""
    parallel = [name for name in floor_modules() if name.startswith("lightning_ciuic.parallel")]
    wire = [name for name in floor_modules() if name.startswith("lightning_ciuic.wire")]
    code = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
        f"for name in {wire!r}:\n"
        "    __import__(name)\n"
        "assert not [m for m in sys.modules if m.startswith(('lightning_ciuic.parallel', 'lightning_ciuic.comm'))], sorted(sys.modules)\n"
        f"for name in {parallel!r}:\n"
        "    __import__(name)\n"
        "assert not [m for m in sys.modules if m.startswith('lightning_ciuic.comm')], sorted(m for m in sys.modules if 'ciuic' in m)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def imported_packages(package: str) -> dict[str, set[str]]:
    """For each module of ``lightning_ciuic.<package>``, the lightning_ciuic modules it imports anywhere in its text."""
    found = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[path.name] = {name for name in names if name.startswith("lightning_ciuic.")}
    return found


@pytest.mark.parametrize("below, above", [("parallel", "comm"), ("wire", "parallel"), ("wire", "comm"), ("strategies", "callbacks")])
def test_a_lower_package_never_imports_a_higher_one(below, above):
    wrong = {module: sorted(n for n in names if n.startswith(f"lightning_ciuic.{above}")) for module, names in imported_packages(below).items()}
    assert not {module: names for module, names in wrong.items() if names}


def test_the_package_root_is_lazy_and_registers_the_strategy_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert {"ciuic", "ciuic_spawn", "ciuic_fork", "ciuic_forkserver"} <= set(StrategyRegistry.available_strategies())
    strategy = StrategyRegistry.get("ciuic_spawn")
    assert type(strategy) is lightning_ciuic.HybridParallelStrategy and strategy._start_method == "spawn"
    assert lightning_ciuic.GradientSyncOptimizer is lightning_ciuic.HybridParallelStrategy  # seed alias
    assert set(lightning_ciuic.__all__) <= set(dir(lightning_ciuic))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        lightning_ciuic.NoSuchThing  # noqa: B018
