"""The layer order of ``core`` (pyproject.toml, ``[tool.importlinter]``): every module imports
only the layers below it, so the core import graph has no cycle; function-local imports
count.  ``core`` never imports the app."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout, done.stdout


def test_core_import_graph_has_no_cycle():
    import grimp

    graph = grimp.build_graph("core", include_external_packages=False)

    def module_of(name: str) -> str:  # core.data.importers.tau2 -> core.data.importers
        return ".".join(name.split(".")[:3])

    def related(a: str, b: str) -> bool:  # a package and its own modules
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    arrows: dict[str, set[str]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = module_of(importer), module_of(imported)
            if not related(a, b):
                arrows.setdefault(a, set()).add(b)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: tuple[str, ...]) -> None:
        seen[node] = 1
        for nxt in sorted(arrows.get(node, ())):
            assert seen.get(nxt) != 1, f"import cycle: {' -> '.join(path + (node, nxt))}"
            if nxt not in seen:
                visit(nxt, path + (node,))
        seen[node] = 2

    for node in sorted(arrows):
        if node not in seen:
            visit(node, ())
    assert len(arrows) > 50  # the graph was really read, module by module


def test_every_layer_is_a_package_that_says_what_it_may_import():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == "core layers")
    layers = [name.strip() for row in contract["layers"] for name in row.split("|")]
    assert len(layers) >= 12
    flat = sorted(p.name for p in (ROOT / "core").glob("*.py") if p.name != "__init__.py")
    assert flat == [], f"modules outside the layer packages: {flat}"
    for layer in layers:
        init = ROOT / "core" / layer / "__init__.py"
        assert init.is_file(), f"core.{layer} is not a package"
        if layer not in ("cli", "policies"):  # the command line and the shipped policies say more
            assert "May import:" in init.read_text(encoding="utf-8"), f"core.{layer} does not say what it may import"


#: What only the app installs (the ``app`` extra): ``core`` returns data, the app draws it.
APP_ONLY_PACKAGES = frozenset({"plotly", "streamlit"})


def _imports_of_app_only_packages(package: str) -> dict[str, set[str]]:
    """Module -> the app-only packages it imports, at any depth (function-local and
    type-checking imports count)."""
    import grimp

    graph = grimp.build_graph(package, include_external_packages=True)
    found: dict[str, set[str]] = {}
    for module in graph.modules:
        if module == package or module.startswith(package + "."):
            hits = {name.split(".")[0] for name in graph.find_modules_directly_imported_by(module)}
            if hits & APP_ONLY_PACKAGES:
                found[module] = hits & APP_ONLY_PACKAGES
    return found


def test_core_imports_neither_plotly_nor_streamlit():
    found = _imports_of_app_only_packages("core")
    assert not found, f"core modules import app-only packages: {found}"
    # the same check sees the app's own imports of both, so it does read external imports
    app = _imports_of_app_only_packages("rwb_app")
    assert {"plotly", "streamlit"} <= set().union(*app.values())


def _uncommented_local_core_imports(source: str) -> list[int]:
    """Line numbers of function-local imports of ``core`` modules with no comment on their first line."""
    import ast
    import io
    import tokenize

    commented = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type == tokenize.COMMENT}
    lines: set[int] = set()
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom):
                imports_core = node.level == 0 and (node.module or "").split(".")[0] == "core"
            elif isinstance(node, ast.Import):
                imports_core = any(alias.name.split(".")[0] == "core" for alias in node.names)
            else:
                continue
            if imports_core and node.lineno not in commented:
                lines.add(node.lineno)
    return sorted(lines)


def test_uncommented_local_core_import_is_found():
    source = ("def deferred():\n"
              "    from core.rl import ppo  # deferred: loads torch\n"
              "    return ppo\n\n"
              "def hoistable():\n"
              "    import core.base.results\n"
              "    from core.base.results import dumps\n"
              "    return dumps, core\n")
    assert _uncommented_local_core_imports(source) == [6, 7]


def test_every_function_local_core_import_says_why_it_is_deferred():
    """A ``core`` module imports another ``core`` module inside a function only to defer a heavy
    dependency (torch, pandas, optuna …) or to keep ``rwb --help`` fast, and says so on the line."""
    found = {}
    for path in sorted((ROOT / "core").rglob("*.py")):
        lines = _uncommented_local_core_imports(path.read_text(encoding="utf-8"))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"function-local core imports without a reason comment: {found}"
