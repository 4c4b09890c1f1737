"""The shape of the package: layers imported only downwards, no import cycles, no global state
changed by importing it, short functions, a project that cites nothing outside itself, a config
reference page that matches the code, and a wheel that carries every package and the recipes."""

from __future__ import annotations

import ast
import graphlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dpojax"

# Lowest first: a module may import its own layer and the layers before it, never later ones.
LAYERS = (
    (
        "dpojax.errors",
        "dpojax.urls",
        "dpojax.schema",
        "dpojax.interrupts",
        "dpojax.xla_env",
        "dpojax.runtime",
        "dpojax.hardware",
    ),
    ("dpojax.models", "dpojax.data"),
    ("dpojax.train",),
    ("dpojax.collect",),
    ("dpojax.workflows", "dpojax.customizer.client"),
    ("dpojax.config",),
    ("dpojax.jobs",),
    ("dpojax.customizer_server",),
    ("dpojax.cli",),
    ("dpojax.main", "dpojax.api"),
)
CORE = ("dpojax.models", "dpojax.data", "dpojax.train")
WINGS = (
    "dpojax.jobs",
    "dpojax.workflows",
    "dpojax.customizer",
    "dpojax.customizer_server",
)
MAX_FUNCTION_LINES = 80
# A module longer than this says why in its docstring, in a paragraph that starts "Why one module".
MAX_MODULE_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """dpojax modules imported anywhere in `tree` (function-level imports included)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpojax"):
            for alias in node.names:  # `from dpojax.jobs import train` imports a module
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dpojax")}
    return out - {"dpojax"}


def _layer(module: str) -> int:
    best = None
    for index, members in enumerate(LAYERS):
        for prefix in members:
            inside = module == prefix or module.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of tests/hygiene/test_architecture.py"
    return best[0]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {name: _imports(tree, names) & names for name, tree in modules.items()}


def test_layers_import_only_downwards():
    wrong = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in _graph().items()
        if module != "dpojax"
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_core_never_imports_the_wings():
    wrong = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.startswith(CORE)
        for target in targets
        if target.startswith(WINGS)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    # Package __init__ modules re-export their children: an edge child -> package is no cycle.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


@pytest.mark.slow
def test_importing_the_package_changes_no_global_state():
    """Importing every module leaves the environment (XLA_FLAGS above all), the signal handlers
    and the root logger as they were (the libraries dpojax uses, imported first, set their own
    variables, e.g. TF_CPP_MIN_LOG_LEVEL)."""
    code = """
import importlib, json, logging, os, pkgutil, signal, sys
import absl.logging, flax, jax, matplotlib, ml_collections, optax, orbax.checkpoint, transformers
before = (dict(os.environ), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT),
          list(logging.getLogger().handlers), logging.getLogger().level)
import dpojax
for info in pkgutil.walk_packages(dpojax.__path__, "dpojax."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
after = (dict(os.environ), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT),
         list(logging.getLogger().handlers), logging.getLogger().level)
changed = {k for k in set(before[0]) | set(after[0]) if before[0].get(k) != after[0].get(k)}
print(json.dumps({"env": sorted(changed), "rest_same": before[1:] == after[1:]}))
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = out.stdout.strip().splitlines()[-1]
    assert result == '{"env": [], "rest_same": true}', result


def _own_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body without its docstring and without the functions defined in
    it (route handlers registered by a function are measured on their own)."""
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    lines = set(range(body[0].lineno, node.end_lineno + 1))
    for inner in ast.walk(node):
        if inner is not node and isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([inner.lineno, *(d.lineno for d in inner.decorator_list)])
            lines -= set(range(first, inner.end_lineno + 1))
    return len(lines)


def _long_functions(folder: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and _own_lines(node) > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_functions_are_short():
    """No function over MAX_FUNCTION_LINES lines of its own (docstring and nested functions
    aside)."""
    assert not _long_functions()


# Documents outside the repository (written in pieces so that this file does not match itself).
OUTSIDE = (
    "sha" + "red/",
    "DES" + "IGN.md",
    "STY" + "LE.md",
    "dpo_" + "losses.md",
    "nat_" + "customizer.md",
)
CITATIONS = re.compile(
    r"(^|[^_A-Za-z])(" + "|".join(re.escape(name) for name in OUTSIDE) + r")|reference \u00a7"
)


def test_project_cites_nothing_outside_itself():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    wrong = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".ipynb") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if CITATIONS.search(line):
                wrong.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not wrong, "\n".join(wrong)


def test_config_reference_page_is_current():
    """docs/config.md is what `python -m dpojax.config` prints (regenerate it when keys change)."""
    from dpojax.config import reference_page

    assert (ROOT / "docs" / "config.md").read_text() == reference_page()


def test_config_imports_no_job():
    """Loading the config (what every recipe does) imports no job, not even indirectly: the
    config is a leaf that jobs import."""
    code = (
        "import sys, dpojax.config\n"
        "print(sorted(m for m in sys.modules if m.startswith(('dpojax.jobs', 'dpojax.main'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    closure, todo, graph = set(), ["dpojax.config"], _graph()
    while todo:
        module = todo.pop()
        for target in graph.get(module, ()):
            if target not in closure:
                closure.add(target)
                todo.append(target)
    assert not [m for m in closure if m.startswith(("dpojax.jobs", "dpojax.main"))], closure


def test_every_mode_names_a_job_that_exists():
    import importlib

    from dpojax.config.modes import MODE_RECORDS

    for mode, target in ((n, m.job) for n, m in MODE_RECORDS.items()):
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), mode


def test_readme_exit_codes_are_the_table():
    """README.md#exit-codes lists exactly the codes of `dpojax.errors.EXITS`, each once (ranges
    like 10-15 included), and no module but dpojax.errors assigns an exit code number."""
    from dpojax.errors import EXITS

    text = (ROOT / "README.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = []
    for cell in re.findall(r"^\| ([\d\-, ]+) \|", text, flags=re.M):
        for part in cell.split(","):
            low, _, high = part.strip().partition("-")
            listed += range(int(low), int(high or low) + 1)
    assert sorted(listed) == sorted(e.code for e in EXITS)
    numbers = re.compile(r"^\s*(EXIT_[A-Z_]+)\s*(?::\s*int)?\s*=\s*\d+", flags=re.M)
    wrong = [
        f"{path.relative_to(ROOT)}: {match.group(1)}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "errors.py" or path.parent != PACKAGE
        for match in numbers.finditer(path.read_text())
    ]
    assert not wrong, "exit codes defined outside dpojax/errors.py:\n" + "\n".join(wrong)


def _literal_constants() -> dict[str, list[str]]:
    """Module-level constants of dpojax whose value is a literal collection of two or more
    items (a choice list, a table of values): repr of the value -> where each is defined."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if not isinstance(value, ast.Tuple | ast.List | ast.Set | ast.Dict):
                continue
            try:
                literal = ast.literal_eval(value)
            except ValueError:
                continue
            if len(literal) < 2:
                continue
            if isinstance(literal, dict):
                literal = sorted(literal.items(), key=repr)
            elif isinstance(literal, set):
                literal = sorted(literal, key=repr)
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found.setdefault(repr(literal), []).append(where)
    return found


def test_no_fact_is_defined_twice():
    """A choice list or table of values (the non-finite policies, the attention choices, the
    padding values of a batch, a server's terminal job statuses, ...) is written once and
    imported everywhere else; and the micro-batch arithmetic and the data-parallel divisibility
    check live only in dpojax/train/batches.py."""
    twice = {value: where for value, where in _literal_constants().items() if len(where) > 1}
    assert not twice, "\n".join(f"{v[:80]} at {', '.join(w)}" for v, w in twice.items())
    arithmetic = re.compile(r"batch_size\s*//|%\s*(data_parallel|blocks)\b")
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "train" / "batches.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if arithmetic.search(line)
    ]
    assert not wrong, "batch arithmetic outside dpojax/train/batches.py:\n" + "\n".join(wrong)


# scripts/: the benchmark and launch scripts and the package they share (scripts/bench/), imported
# with scripts/ on sys.path, as running a script from that folder puts it there.
SCRIPTS = ROOT / "scripts"


def test_script_functions_are_short():
    """The function length rule holds in scripts/ too."""
    assert not _long_functions(SCRIPTS)


def _script_modules(folder: Path) -> dict[str, Path]:
    """The modules under `folder` by the name a script there imports them with."""
    names = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _script_imports(name: str, path: Path, names: set[str]) -> set[str]:
    """The modules of `names` that module `name` imports anywhere (relative imports resolved),
    leaving out the packages that contain it (a package's __init__ may import its children)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *filter(None, [node.module])])
            out |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {t for t in out & names if t != name and not name.startswith(t + ".")}


def _script_cycle(folder: Path) -> list[str] | None:
    """One import cycle among the modules under `folder`, or None."""
    modules = _script_modules(folder)
    graph = {name: _script_imports(name, path, set(modules)) for name, path in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def test_scripts_have_no_import_cycles():
    cycle = _script_cycle(SCRIPTS)
    assert cycle is None, "import cycle in scripts/: " + " -> ".join(cycle)


def test_script_cycles_are_found(tmp_path):
    """The check above sees a cycle through a function-level import and a relative import."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from tool import main\n")
    (tmp_path / "pkg" / "b.py").write_text("from .c import x\n")
    (tmp_path / "tool.py").write_text("from pkg.a import f\nfrom pkg import b\n")
    cycle = _script_cycle(tmp_path)
    assert cycle is not None and {"pkg.a", "tool"} <= set(cycle), cycle
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    return 1\n")
    assert _script_cycle(tmp_path) is None


def test_the_wheel_lists_every_package_and_ships_the_recipes():
    """pyproject.toml lists its packages by hand (setuptools' packages.find would not see the
    package-dir mapping): every package under dpojax/ is in the list, so none is left out of the
    wheel, and dpojax.recipes is configs/ itself, with the model configs its recipes read."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "dpojax").rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted({*tree, "dpojax.recipes"})
    assert setuptools["package-dir"] == {"dpojax.recipes": "configs"}
    assert (ROOT / "configs" / "__init__.py").is_file()
    data = setuptools["package-data"]["dpojax.recipes"]
    files = [p for p in (ROOT / "configs").rglob("*") if p.is_file()]
    wanted = {p for p in files if p.suffix not in (".py", ".pyc")}
    shipped = {p for pattern in data for p in (ROOT / "configs").glob(pattern)}
    assert wanted <= shipped, sorted(map(str, wanted - shipped))


def test_a_long_module_says_why_it_is_one():
    """A module of more than MAX_MODULE_LINES lines either splits or gives its reason in its
    docstring ("Why one module ..."), so a reviewer sees the choice and the next feature does not
    silently grow it further."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_MODULE_LINES and "\nWhy one module" not in "\n" + doc:
            wrong.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not wrong, "split these, or say in the docstring why one module: " + ", ".join(wrong)
