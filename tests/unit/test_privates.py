"""Private attributes of torch, Lightning, transformers and LitData objects are reached only through
lightning_ciuic/compat (its named functions, each saying what it touches and from which version), so an upgrade
that moves one breaks lightning_ciuic/compat/ and tests/unit/test_compat.py, not a run somewhere else."""

import ast
from pathlib import Path

import lightning_ciuic

PACKAGE = Path(lightning_ciuic.__file__).parent
COMPAT = "compat"  # the one room for them: the package lightning_ciuic/compat/

# Our own private names that we keep on objects that are not ours (flags on a user's module, a parameter, a bound
# method): the scan below cannot tell them from someone else's, so they are named here.
OUR_MARKERS = {
    "_pipeline_layout",  # parallel/pipeline_module.py: the cut a module was given (names, stages), on the module
    "_grad_placement_hooked",  # parallel/tensor.py: a DTensor parameter whose gradient hook is installed
    "_data_parallel_world",  # data/world.py: a loader's load_state_dict already wrapped
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _files() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Private names the package defines itself: functions, classes, module and class variables, attributes set on
    ``self``/``cls``, parameters, import aliases."""
    own = set(OUR_MARKERS)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
    return {name for name in own if _private(name)}


def private_uses(trees: dict[Path, ast.Module], own: set[str]) -> list[str]:
    """``path:line: code`` for every use of someone else's private name outside compat: ``obj._name`` (not on
    ``self``/``cls``), ``getattr/setattr/hasattr(obj, "_name")``, and imports of private modules or names."""
    found = []
    for path, tree in trees.items():
        relative = str(path.relative_to(PACKAGE))
        if path.relative_to(PACKAGE).parts[0] == COMPAT:
            continue
        for node in ast.walk(tree):
            bad = False
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                bad = not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr"):
                name = node.args[1] if len(node.args) > 1 else None
                bad = isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value) and name.value not in own
                bad = bad and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("lightning_ciuic"):
                bad = any(_private(part) for part in (node.module or "").split(".")) or any(_private(a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                bad = any(_private(part) for alias in node.names for part in alias.name.split("."))
            if bad:
                found.append(f"lightning_ciuic/{relative}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_no_module_but_compat_uses_a_private_attribute_of_torch_lightning_or_transformers():
    trees = _files()
    uses = private_uses(trees, _own_names(trees))
    assert not uses, "private attributes used outside compat (add a named function to lightning_ciuic/compat/):\n" + "\n".join(uses)


def test_the_scan_finds_what_it_looks_for():
    sample = ast.parse(
        "import torch._subclasses.fake_tensor\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "from torch.distributed.distributed_c10d import _resolve_process_group\n"
        "def f(model, func, self):\n"
        "    plan = model._tp_plan\n"
        "    name = func._overloadpacket\n"
        "    plan = getattr(model, '_pp_plan', None)\n"
        "    ours = model._pipeline_layout, self._anything, model.__dict__\n"
    )
    uses = private_uses({PACKAGE / "sample.py": sample}, _own_names({PACKAGE / "sample.py": sample}))
    assert [use.split(": ", 1)[0] for use in uses] == [f"lightning_ciuic/sample.py:{n}" for n in (1, 2, 3, 5, 6, 7)]


EXTERNAL = ("torch", "lightning", "transformers", "litdata")


def overridden_private_hooks() -> set[str]:
    """``module.Class._name`` of every private method or property of a torch/Lightning/transformers/LitData class that
    a class of the package defines again."""
    import importlib
    import inspect

    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == name]:
            for attr, value in vars(cls).items():
                if not _private(attr) or not isinstance(value, (property, classmethod, staticmethod)) and not inspect.isfunction(value):
                    continue
                for base in cls.__mro__[1:]:
                    if base.__module__.split(".")[0] in EXTERNAL and attr in vars(base):
                        found.add(f"{base.__module__}.{base.__qualname__}.{attr}")
                        break
    return found


def test_the_private_hooks_the_package_overrides_are_those_compat_names():
    from lightning_ciuic import compat

    assert overridden_private_hooks() == set(compat.OVERRIDDEN_PRIVATE_HOOKS)
