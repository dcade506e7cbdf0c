"""Run Lightning's own DDP tests (``tests_pytorch``) against ``HybridParallelStrategy`` and compare with DDP.

Contract
--------
``python tools/lightning_tests.py TESTS_DIR [--files F ...] [-k EXPR] [--out results.json]``

* ``TESTS_DIR`` is an extracted Lightning ``tests/`` tree (it must contain ``tests_pytorch/``), e.g.::

      mkdir -p /tmp/lightning-2.6.5
      git -C <lightning clone> archive 2.6.5 tests/tests_pytorch | tar -x -C /tmp/lightning-2.6.5
      .venv/bin/python tools/lightning_tests.py /tmp/lightning-2.6.5/tests --out /tmp/lightning-tests.json

  It is never modified: the tree is copied twice into a temporary directory (``--keep`` keeps it, with the logs).
* Selection: every ``test_*`` function (or ``Test*`` method) of a ``tests_pytorch/**/test_*.py`` file whose code,
  decorators, or module-level helpers/fixtures/constants it uses (transitively) mention one of the strategy strings
  ``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"`` or the name ``DDPStrategy``. GPU/TPU-only and
  standalone cases stay in the selection; pytest skips them (``RunIf``), so they count as skipped in both runs.
  ``--files`` narrows the selection to some files (paths relative to ``tests_pytorch/``); ``-k`` is passed to pytest.
  A file whose module cannot be imported by the project's Python (a missing test dependency) is left out and
  listed under ``skipped_files``; nothing is installed.
* Two runs, each ``<python> -m pytest`` (default: the project's ``.venv/bin/python``) from ``tests_pytorch/`` with
  Lightning 2.6.5's pytest settings (from its ``pyproject.toml``: strict markers, ``error::FutureWarning``, strict
  xfail), ``-p no:cacheprovider``, ``--timeout 120 --timeout-method=thread`` and ``--junitxml`` (results are read
  from it):

  - ``ddp``: the copy as extracted (the reference);
  - ``ours``: the copy with, in every test file: the string constants ``"ddp"`` -> ``"ciuic"`` (popen, one script
    run per rank), ``"ddp_spawn"`` -> ``"ciuic_spawn"``, ``"ddp_fork"`` -> ``"ciuic_fork"``, ``"ddp_notebook"`` ->
    ``"ciuic_notebook"`` (an alias of ``ciuic_fork`` registered by the copy's conftest only, so test ids stay
    distinct); ``DDPStrategy(...)`` calls without positional arguments whose keywords all exist on
    ``HybridParallelStrategy`` (``start_method``, ``process_group_backend``, ``timeout``, ``cluster_environment``,
    ``parallel_devices``, ``accelerator``, ``checkpoint_io``, ``precision_plugin``; ``start_method`` values are the
    same names) -> ``HybridParallelStrategy(...)``; and every ``isinstance(x, C)`` -> a helper that also accepts a
    ``HybridParallelStrategy`` where ``C`` is or contains ``DDPStrategy``. Other DDP spellings
    (``"ddp_find_unused_parameters_true"``, ``DDPStrategy(find_unused_parameters=...)``, subclasses) stay DDP.

  pytest-timeout's thread method ends the whole process on a timeout; a per-run progress plugin (written into
  the temporary directory) records each test, so the run is resumed after the test that timed out (recorded as a
  failure, "Timeout").
* Output: per-file passed/failed/errors/skipped for both runs, totals, and every test id (with DDP's parameter
  names) that passes with DDP but fails or errors with ours, with the first line of its error; ``--out`` writes
  the same as JSON (plus the selection, the rewrites per file and every other status change).

This tool is not part of ``make test``; it needs nothing beyond the project's test environment, except that some
Lightning test files need packages that environment lacks (they are reported as skipped files).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = PROJECT_ROOT / ".venv" / "bin" / "python"

STRING_MAP = {"ddp": "ciuic", "ddp_spawn": "ciuic_spawn", "ddp_fork": "ciuic_fork", "ddp_notebook": "ciuic_notebook"}
REVERSE_ID_MAP = {v: k for k, v in STRING_MAP.items()}
COMPATIBLE_KWARGS = {
    "start_method", "process_group_backend", "timeout", "cluster_environment", "parallel_devices", "accelerator",
    "checkpoint_io", "precision_plugin",
}
IMPORT_LINE = (
    "from lightning_ciuic.strategies.hybrid import HybridParallelStrategy  # lightning_tests.py rewrite\n"
    "from tests_pytorch._ciuic_compat import ciuic_isinstance as _ciuic_isinstance  # lightning_tests.py rewrite\n"
)
COMPAT_MODULE = '''\
"""Written by lightning_ciuic's tools/lightning_tests.py: isinstance that lets HybridParallelStrategy pass for DDP."""
import types

from lightning.pytorch.strategies import DDPStrategy

from lightning_ciuic.strategies.hybrid import HybridParallelStrategy


def _classes(spec):
    if isinstance(spec, tuple):
        for item in spec:
            yield from _classes(item)
    elif isinstance(spec, types.UnionType):
        yield from _classes(spec.__args__)
    else:
        yield spec


def ciuic_isinstance(obj, spec):
    if isinstance(obj, spec):
        return True
    return isinstance(obj, HybridParallelStrategy) and any(c is DDPStrategy for c in _classes(spec))
'''
CONFTEST_APPEND = '''

# --- appended by lightning_ciuic's tools/lightning_tests.py (the "ours" run) ---
import lightning_ciuic  # noqa: E402,F401  registers "ciuic", "ciuic_spawn", "ciuic_fork"
from lightning.pytorch.strategies import StrategyRegistry as _CiuicRegistry  # noqa: E402
from lightning_ciuic.strategies.registry import hybrid_parallel_strategy as _ciuic_factory  # noqa: E402

if "ciuic_notebook" not in _CiuicRegistry:  # "ddp_notebook" is fork-started DDP: the same as "ciuic_fork"
    _CiuicRegistry.register("ciuic_notebook", _ciuic_factory, description="alias of ciuic_fork", start_method="fork")
'''
# Lightning 2.6.5's [tool.pytest.ini_options] (pyproject.toml), less the doctest/colour/legacy options for src/, plus
# the `flaky` marker of pytest-rerunfailures (in Lightning's test requirements; not needed here: no reruns).
PYTEST_INI = """\
[pytest]
addopts = --strict-markers --disable-pytest-warnings
markers =
    cloud: Run the cloud tests for example
    flaky: pytest-rerunfailures' marker (not installed here: flaky tests run once)
filterwarnings =
    error::FutureWarning
    ignore::FutureWarning:onnxscript
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
xfail_strict = true
junit_family = legacy
junit_duration_report = call
"""
# Loaded with -p in the pytest process only: keeps the selected items, and logs each test as it starts and ends
# so that a run ended by pytest-timeout (os._exit) can be resumed.
PROGRESS_PLUGIN = '''\
import json, os

_OWNER = "LIGHTNING_TESTS_PROGRESS_OWNER"
_FILE = os.environ.get("LIGHTNING_TESTS_PROGRESS")
_SELECT = os.environ.get("LIGHTNING_TESTS_SELECT")


def _key(nodeid):
    i = nodeid.find("tests_pytorch/")
    return nodeid[i:] if i >= 0 else nodeid


def _mine():
    return _FILE and os.environ.get(_OWNER) == str(os.getpid())


def _log(**event):
    if _mine():
        with open(_FILE, "a") as f:
            f.write(json.dumps(event) + "\\n")


def pytest_configure(config):
    if _FILE and _OWNER not in os.environ:
        os.environ[_OWNER] = str(os.getpid())  # rank processes re-running pytest do not write


def pytest_collection_modifyitems(config, items):
    if not _SELECT:
        return
    with open(_SELECT) as f:
        sel = json.load(f)
    functions, exact = set(sel.get("functions", [])), set(sel.get("exact", []))
    keep, drop = [], []
    for item in items:
        key = _key(item.nodeid)
        (keep if key in exact or key.split("[", 1)[0] in functions else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_finish(session):
    _log(event="collected", ids=[_key(i.nodeid) for i in session.items])


def pytest_runtest_logstart(nodeid, location):
    _log(event="start", id=_key(nodeid))


def pytest_runtest_logreport(report):
    msg = ""
    if report.outcome != "passed" and report.longrepr is not None:
        crash = getattr(report.longrepr, "reprcrash", None)
        msg = crash.message if crash is not None else str(report.longrepr)
    _log(event="report", id=_key(report.nodeid), when=report.when, outcome=report.outcome, msg=msg[:2000])
'''


# -- selection -------------------------------------------------------------------------------------------------
def _mentions_ddp(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in STRING_MAP:
            return True
        if isinstance(sub, ast.Name) and sub.id == "DDPStrategy":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "DDPStrategy":
            return True
    return False


def _names_used(node: ast.AST) -> set[str]:
    names = {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # fixtures are used by argument name
        names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    return names


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def select_tests(tree: ast.Module) -> list[str]:
    """The test functions (``name`` or ``Class::name``) of a module that build or check a DDP strategy."""
    defs: dict[str, list[ast.stmt]] = defaultdict(list)
    for stmt in tree.body:
        for name in _defined_names(stmt):
            defs[name].append(stmt)
    marked = {n for n, stmts in defs.items() if any(_mentions_ddp(s) for s in stmts)}
    changed = True
    while changed:  # helpers that use marked helpers are marked too
        changed = False
        for name, stmts in defs.items():
            if name not in marked and any(_names_used(s) & (marked - {name}) for s in stmts):
                marked.add(name)
                changed = True

    def hit(node: ast.AST) -> bool:
        return _mentions_ddp(node) or bool(_names_used(node) & marked)

    selected = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test"):
            if hit(stmt):
                selected.append(stmt.name)
        elif isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test"):
            tests = [s for s in stmt.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and s.name.startswith("test")]
            rest = [s for s in stmt.body if s not in tests] + list(stmt.decorator_list) + list(stmt.bases)
            whole = any(hit(s) for s in rest)
            selected += [f"{stmt.name}::{t.name}" for t in tests if whole or hit(t)]
    return selected


# -- rewriting ---------------------------------------------------------------------------------------------------
def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def _docstring_nodes(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def rewrite_source(source: str) -> tuple[str, dict[str, int]]:
    """The "ours" version of a test module and how many of each rewrite it got (unchanged if none applied)."""
    tree = ast.parse(source)
    starts = _offsets(source)
    # ast column offsets count UTF-8 bytes; work on bytes per line to be exact
    lines = source.splitlines(keepends=True)

    def pos(lineno: int, col: int) -> int:
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    edits: list[tuple[int, int, str]] = []
    counts: dict[str, int] = defaultdict(int)
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STRING_MAP
                and id(node) not in docstrings):
            a, b = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
            quote = source[a]
            edits.append((a, b, f"{quote}{STRING_MAP[node.value]}{quote}"))
            counts[f'"{node.value}"'] += 1
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "DDPStrategy":
                kwargs = {k.arg for k in node.keywords}
                if not node.args and None not in kwargs and kwargs <= COMPATIBLE_KWARGS:
                    edits.append((pos(func.lineno, func.col_offset), pos(func.end_lineno, func.end_col_offset),
                                  "HybridParallelStrategy"))
                    counts["DDPStrategy(...)"] += 1
            elif isinstance(func, ast.Name) and func.id == "isinstance":
                edits.append((pos(func.lineno, func.col_offset), pos(func.end_lineno, func.end_col_offset),
                              "_ciuic_isinstance"))
                counts["isinstance"] += 1
    if not any(k != "isinstance" for k in counts):
        return source, {}
    for a, b, text in sorted(edits, reverse=True):
        source = source[:a] + text + source[b:]
    # the imports go after any `from __future__` import (and the module docstring before it)
    future = [s for s in tree.body if isinstance(s, ast.ImportFrom) and s.module == "__future__"]
    insert_at = starts[future[-1].end_lineno] if future else 0
    source = source[:insert_at] + IMPORT_LINE + source[insert_at:]
    return source, dict(counts)


# -- running -----------------------------------------------------------------------------------------------------
def _status(case: ET.Element) -> tuple[str, str]:
    for tag, status in (("failure", "failed"), ("error", "error")):
        el = case.find(tag)
        if el is not None:
            message = (el.get("message") or el.text or "").strip()
            head = message.splitlines()[0].rstrip() if message else ""
            if head.endswith(":"):  # e.g. ProcessRaisedException: the cause is a rank's error, at the end of the text
                causes = re.findall(r"^E\s+([\w.]*(?:Error|Exception|Interrupt)\b.*)$", el.text or "", re.M)
                if causes:
                    message = f"{head} {causes[-1].strip()}\n{message}"
            return status, message
    el = case.find("skipped")
    if el is not None:
        return "skipped", (el.get("message") or "").strip()
    return "passed", ""


def parse_junit(path: Path) -> dict[str, tuple[str, str]]:
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or ""
        classname, name = case.get("classname") or "", case.get("name") or ""
        if not file:  # a collection error: classname is empty, name is the module
            results[f"{name.replace('.', '/')}.py::<collection>"] = _status(case)
            continue
        module = file[:-3].replace("/", ".")
        classes = classname[len(module):].strip(".").split(".") if classname.startswith(module) else []
        nodeid = "::".join([file] + [c for c in classes if c] + [name])
        i = nodeid.find("tests_pytorch/")
        results[nodeid[i:] if i >= 0 else nodeid] = _status(case)
    return results


def parse_progress(path: Path) -> tuple[list[str], dict[str, tuple[str, str]], Optional[str]]:
    """What a run ended early did: the ids it collected, the results it finished, the test it was in."""
    collected: list[str] = []
    results: dict[str, tuple[str, str]] = {}
    current = None
    if not path.exists():
        return collected, results, current
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "collected":
            collected = event["ids"]
        elif event["event"] == "start":
            current = event["id"]
        elif event["event"] == "report":
            old = results.get(event["id"], ("passed", ""))
            outcome, when = event["outcome"], event["when"]
            if outcome == "failed":
                status = "failed" if when == "call" else "error"
                if old[0] not in ("failed", "error"):
                    old = (status, event["msg"])
            elif outcome == "skipped" and old[0] == "passed":
                old = ("skipped", event["msg"])
            results[event["id"]] = old
            if when == "teardown":
                current = None
    return collected, results, current


def run_variant(name: str, root: Path, selection: dict[str, Any], files: list[str], args: argparse.Namespace,
                plugin_dir: Path) -> dict[str, tuple[str, str]]:
    """Run pytest on one copy until every selected test has a result (resuming after timeouts)."""
    results: dict[str, tuple[str, str]] = {}
    cwd = root / "tests" / "tests_pytorch"
    remaining: Optional[set[str]] = None
    for attempt in range(1, 1000):
        select_file = root / f"select-{attempt}.json"
        if remaining is None:
            select_file.write_text(json.dumps(selection))
        else:
            select_file.write_text(json.dumps({"exact": sorted(remaining)}))
        junit, progress, log = (root / f"{n}-{attempt}.{e}" for n, e in (("junit", "xml"), ("progress", "jsonl"),
                                                                        ("pytest", "log")))
        cmd = [str(args.python), "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
               "-p", "no:cacheprovider", "-p", "_lightning_tests_progress",
               "--timeout", str(args.timeout), "--timeout-method=thread",
               "--continue-on-collection-errors", "-q", "-rfE", f"--junitxml={junit}"]
        if args.k:
            cmd += ["-k", args.k]
        cmd += files
        env = dict(os.environ, LIGHTNING_TESTS_PROGRESS=str(progress), LIGHTNING_TESTS_SELECT=str(select_file))
        env.pop("PL_RUN_STANDALONE_TESTS", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir), env.get("PYTHONPATH", "")) if p)
        started = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        collected, progressed, current = parse_progress(progress)
        if junit.exists():
            results.update(parse_junit(junit))
            ended_early = False
        else:
            results.update(progressed)
            ended_early = True
            if current is not None:
                timed_out = "Timeout" in log.read_text(errors="replace")[-20000:]
                why = (f"Timeout: over {args.timeout} s (pytest-timeout ended the process)" if timed_out
                       else f"pytest process died (exit code {proc.returncode}) in this test")
                results[current] = ("failed", why)
        print(f"[{name}] pytest run {attempt}: exit {proc.returncode}, {len(results)} results,"
              f" {time.monotonic() - started:.0f} s (log {log})", flush=True)
        if not ended_early:
            return results
        left = {i for i in collected if i not in results}
        if remaining is not None and left == remaining or not collected:
            print(f"[{name}] no progress; giving up on {len(left)} tests", flush=True)
            for i in left:
                results[i] = ("error", "not run: pytest kept ending early")
            return results
        if not left:
            return results
        remaining = left
    return results


# -- comparing ---------------------------------------------------------------------------------------------------
def ddp_id(our_id: str) -> str:
    """Our test id spelled with DDP's parameter names (the strategy strings were rewritten in the ids too)."""
    if "[" not in our_id:
        return our_id
    head, params = our_id.split("[", 1)
    pattern = r"(?<![A-Za-z0-9_])(" + "|".join(sorted(REVERSE_ID_MAP, key=len, reverse=True)) + r")(?![A-Za-z0-9_])"
    return head + "[" + re.sub(pattern, lambda m: REVERSE_ID_MAP[m.group(1)], params)


def file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def counts_by_file(results: dict[str, tuple[str, str]]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = defaultdict(lambda: {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
    for test_id, (status, _) in results.items():
        table[file_of(test_id)][status] += 1
    return {f: table[f] for f in sorted(table)}


def totals(table: dict[str, dict[str, int]]) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for row in table.values():
        for k in out:
            out[k] += row[k]
    return out


def first_line(message: str) -> str:
    for line in message.splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def importable(python: Path, tests_dir: Path, files: list[str]) -> dict[str, str]:
    """Files whose module does not import with the project's Python, and the module that is missing."""
    script = textwrap.dedent("""
        import importlib, json, sys, warnings
        warnings.simplefilter("ignore")
        bad = {}
        for f in json.loads(sys.argv[1]):
            try:
                importlib.import_module("tests_pytorch." + f[:-3].replace("/", "."))
            except ImportError as e:
                bad[f] = f"{type(e).__name__}: {e}"
            except Exception as e:
                pass  # other import-time errors: pytest reports them as collection errors
        print(json.dumps(bad))
    """)
    proc = subprocess.run([str(python), "-c", script, json.dumps(files)], cwd=tests_dir, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(tests_dir), PYTHONDONTWRITEBYTECODE="1"))
    if proc.returncode != 0:
        raise SystemExit(f"could not import-check the test files:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests_dir", type=Path, help="an extracted Lightning tests/ tree (contains tests_pytorch/)")
    parser.add_argument("--files", nargs="+", default=None,
                        help="only these test files (relative to tests_pytorch/, e.g. strategies/test_ddp.py)")
    parser.add_argument("-k", default=None, help="pytest -k expression (ours: written with the 'ciuic' names)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--python", type=Path, default=DEFAULT_PYTHON, help="interpreter with lightning installed")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    parser.add_argument("--runs", default="ddp,ours", help="which runs: ddp, ours or ddp,ours")
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies and logs")
    args = parser.parse_args(argv)

    source_root = args.tests_dir.resolve()
    if not (source_root / "tests_pytorch" / "conftest.py").exists():
        parser.error(f"{source_root} has no tests_pytorch/conftest.py")
    tp = source_root / "tests_pytorch"
    wanted = None
    if args.files:
        wanted = {f.split("tests_pytorch/", 1)[-1] for f in args.files}
    selection: dict[str, list[str]] = {}
    for path in sorted(tp.rglob("test_*.py")):
        rel = path.relative_to(tp).as_posix()
        if wanted is not None and rel not in wanted:
            continue
        tests = select_tests(ast.parse(path.read_text()))
        if tests:
            selection[rel] = tests
    if wanted:
        for f in sorted(wanted - set(selection)):
            print(f"note: {f}: no test there builds a DDP strategy (or no such file)")
    skipped_files = importable(args.python, source_root, list(selection))
    for f, why in skipped_files.items():
        print(f"skipping {f}: {why}")
        selection.pop(f)
    n_funcs = sum(len(v) for v in selection.values())
    print(f"selected {n_funcs} test functions in {len(selection)} files")
    if args.list:
        for f, tests in selection.items():
            print(f"  {f}: {len(tests)}: {' '.join(tests)}")
        return 0

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="lightning-tests-"))
    plugin_dir = tmp / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / "_lightning_tests_progress.py").write_text(PROGRESS_PLUGIN)
    functions = sorted(f"tests_pytorch/{f}::{t}" for f, tests in selection.items() for t in tests)
    rewrites: dict[str, dict[str, int]] = {}
    results: dict[str, dict[str, tuple[str, str]]] = {}
    try:
        for name in runs:
            root = tmp / name
            shutil.copytree(source_root, root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
            (root / "pytest.ini").write_text(PYTEST_INI)
            if name == "ours":
                tpc = root / "tests" / "tests_pytorch"
                (tpc / "_ciuic_compat.py").write_text(COMPAT_MODULE)
                with open(tpc / "conftest.py", "a") as f:
                    f.write(CONFTEST_APPEND)
                for path in sorted(tpc.rglob("*.py")):
                    new, counts = rewrite_source(path.read_text())
                    if counts:
                        path.write_text(new)
                        rewrites[path.relative_to(tpc).as_posix()] = counts
            print(f"[{name}] running {n_funcs} test functions in {tmp / name}", flush=True)
            results[name] = run_variant(name, root, {"functions": functions}, list(selection), args, plugin_dir)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    tables = {name: counts_by_file(res) for name, res in results.items()}
    report: dict[str, Any] = {
        "tests_dir": str(source_root), "command": [sys.executable] + sys.argv, "selection": selection,
        "skipped_files": skipped_files, "rewrites": rewrites, "per_file": tables,
        "totals": {name: totals(t) for name, t in tables.items()},
    }
    if "ddp" in results and "ours" in results:
        ref = results["ddp"]
        ours = {ddp_id(k): v for k, v in results["ours"].items()}
        regressions, changes = [], []
        for test_id in sorted(set(ref) | set(ours)):
            a, b = ref.get(test_id, ("missing", "")), ours.get(test_id, ("missing", ""))
            if a[0] == "passed" and b[0] in ("failed", "error", "missing"):
                regressions.append({"id": test_id, "ours": b[0], "error": first_line(b[1])})
            elif a[0] != b[0]:
                changes.append({"id": test_id, "ddp": a[0], "ours": b[0], "ddp_error": first_line(a[1]),
                                "ours_error": first_line(b[1])})
        report["passes_with_ddp_fails_with_ours"] = regressions
        report["other_status_changes"] = changes

    files = sorted({f for t in tables.values() for f in t})
    print(f"\n{'file':<62} " + "  ".join(f"{n + ' p/f/e/s':>18}" for n in tables))
    for f in files:
        cells = []
        for t in tables.values():
            r = t.get(f, {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
            cells.append(f"{r['passed']}/{r['failed']}/{r['error']}/{r['skipped']}".rjust(18))
        print(f"{f:<62} " + "  ".join(cells))
    for name, tot in report["totals"].items():
        print(f"total {name}: {tot['passed']} passed, {tot['failed']} failed, {tot['error']} errors,"
              f" {tot['skipped']} skipped")
    if skipped_files:
        print(f"files left out (not importable): {', '.join(sorted(skipped_files))}")
    if "passes_with_ddp_fails_with_ours" in report:
        regs = report["passes_with_ddp_fails_with_ours"]
        print(f"\n{len(regs)} tests pass with DDP but fail with ours:")
        for r in regs:
            print(f"  {r['id']}  [{r['ours']}] {r['error']}")
        print(f"{len(report['other_status_changes'])} other status changes (see --out)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
