"""The framework-free floors (wire/, parallel/, comm/, checkpoint/, data/ and the advisor) import with Lightning blocked,
the floors stack one way (wire/ below parallel/ below comm/; callbacks/ above strategies/), and the package root loads
its public names lazily while registering the strategy names where Lightning is installed."""

import ast
import subprocess
import sys
from pathlib import Path
from typing import Optional

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


# --- The floors: which unit (a sub-package or top-level module of lightning_ciuic) may import which ----------------

# Bottom first: a unit imports only units before it (module-level, lazy imports inside functions and TYPE_CHECKING
# imports alike). "lightning_ciuic" is the package root, the façade of public names (imported as `lightning_ciuic`
# or `from lightning_ciuic import SomeClass`); `from lightning_ciuic import compat` is an import of compat.
FLOOR_ORDER = (
    "validation", "tensors", "timeline", "compat", "wire",  # leaves (wire: codecs, timing, broadcast_from_first)
    "parallel",  # no Lightning
    "comm",  # no Lightning; data-parallel engines over parallel/'s layouts
    "data", "checkpoint", "advice",  # no Lightning
    "config",  # ParallelismConfig: every degree and option, over parallel/ and comm/ (no Lightning)
    "telemetry", "progress", "cli_parsing", "plugins", "huggingface",  # Lightning from here up
    "strategies", "callbacks", "summary", "testing",
    "planner",  # reads a run's config and strategy, steps its layout (lightning-ciuic plan)
    "lightning_ciuic", "cli", "__main__",
)

# Imports that run up the floors and are known; empty: none (issue 46 removed the last three).
PENDING: set[tuple[str, str]] = set()


def _unit_of(name: str) -> Optional[str]:
    """The unit a dotted module name (or ``lightning_ciuic.<public name>``) belongs to; None outside the package."""
    parts = name.split(".")
    if parts[0] != "lightning_ciuic":
        return None
    if len(parts) == 1:
        return "lightning_ciuic"
    if (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file():
        return parts[1]
    return "lightning_ciuic"  # a public name of the façade


def package_imports() -> list[tuple[str, str, str]]:
    """``(importing unit, imported unit, "path:line: statement")`` for every import between two units."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        unit = _unit_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                imported = _unit_of(target)
                if imported is not None and imported != unit:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
                    found.append((unit, imported, where))
    return found


def test_every_unit_has_its_floor():
    units = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    units |= {path.parent.name for path in PACKAGE.glob("*/__init__.py")} | {"lightning_ciuic"}
    assert len(set(FLOOR_ORDER)) == len(FLOOR_ORDER)
    assert units == set(FLOOR_ORDER), f"units without a floor (add to FLOOR_ORDER): {sorted(units - set(FLOOR_ORDER))}; gone: {sorted(set(FLOOR_ORDER) - units)}"


def test_every_import_between_units_goes_down_the_floors():
    floor = {unit: i for i, unit in enumerate(FLOOR_ORDER)}
    imports = package_imports()
    assert len(imports) > 100  # the scan sees lazy imports too (cli.py's commands import inside functions)
    upward = list(dict.fromkeys(  # one line per import statement
        f"{where}  ({unit} imports {imported}, which is above it)"
        for unit, imported, where in imports
        if floor[imported] > floor[unit] and (unit, imported) not in PENDING
    ))
    assert not upward, "imports that run up the floors (FLOOR_ORDER):\n" + "\n".join(upward)
    still_pending = {(unit, imported) for unit, imported, _ in imports} & PENDING
    assert still_pending == PENDING, f"PENDING edges gone: delete {sorted(PENDING - still_pending)} from PENDING"


MAX_LINES = 600
LONG_PENDING: set[str] = set()  # files known to be over MAX_LINES: none


def test_no_file_of_the_package_is_over_600_lines():
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    long = {path: n for path, n in lengths.items() if n > MAX_LINES and path not in LONG_PENDING}
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"
    assert all(lengths[path] > MAX_LINES for path in LONG_PENDING), "a LONG_PENDING file is short now: delete it there"
