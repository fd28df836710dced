"""The house rules of the code base (docs/style.md), checked on the code itself.

- ``core`` never imports streamlit (production imports ``core``); only ``core.cli`` may
  import typer.
- ``pages/`` stay thin: no torch, sqlite3, sqlite_utils or pandas, no SQL text.
- No ``unsafe_allow_html=True`` in the app or its pages.
- No pickle in product code; ``torch.load`` only with ``weights_only=True``.
- No "TODO"/"FIXME"/"stub" in product code.
- Every ``rwb`` command and option has help text.
- ``.ci/run`` runs exactly the README's test command.
- A module docstring under ``core/`` is at most ``MAX_MODULE_DOCSTRING_LINES`` lines; detail lives in docs/.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("core", "app", "pages")


def _py_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported_modules(tree: ast.AST) -> list[tuple[str, int]]:
    """Top-level names of every module imported (``import a.b`` / ``from a import b`` /
    ``importlib.import_module("a")`` / ``__import__("a")``), with the line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module.split(".")[0], node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module",
                                                                           "__import__")))):
            found.append((node.args[0].value.split(".")[0], node.lineno))
    return found


# --------------------------------------------------------------------------- core imports
_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import core

    # pkgutil.walk_packages would import core.cli itself to look inside it; walk by hand
    # so that the non-CLI check never imports the CLI package.
    names = []

    def walk(package, skip):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if info.name == skip or info.name.endswith(".__main__"):
                continue  # __main__ runs the program on import: it is not a library module
            names.append(info.name)
            module = importlib.import_module(info.name)
            if info.ispkg:
                walk(module, skip)

    if CLI_FLAG:
        names.append("core.cli")
        walk(importlib.import_module("core.cli"), None)
    else:
        walk(core, "core.cli")
    print(json.dumps({"modules": names,
                      "forbidden": sorted(m for m in ("streamlit", "typer") if m in sys.modules)}))
""")


def _import_core(cli: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL.replace("CLI_FLAG", str(cli))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_core_never_imports_streamlit_nor_typer():
    """Every module of ``core`` except the CLI, imported together in a fresh process."""
    result = _import_core(cli=False)
    assert "core.records.store" in result["modules"] and "core.records.episodes" in result["modules"]
    assert result["forbidden"] == [], (
        f"importing {len(result['modules'])} core modules pulled in {result['forbidden']}; "
        "core must not import streamlit, and only core.cli may import typer")


def test_core_cli_imports_typer_but_not_streamlit():
    result = _import_core(cli=True)
    assert "core.cli" in result["modules"]
    assert result["forbidden"] == ["typer"], (
        f"core.cli pulled in {result['forbidden']}; it may import typer but never streamlit "
        "(`rwb app` starts Streamlit in its own process)")


def test_import_checker_sees_streamlit(tmp_path):
    """The subprocess check above really notices a forbidden import."""
    probe = "import sys, core.records.store, streamlit; print('streamlit' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "True"


# --------------------------------------------------------------------------- thin pages
PAGE_FORBIDDEN = {"torch", "sqlite3", "sqlite_utils", "pandas"}
SQL = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|DROP|ALTER|WITH)\s", re.IGNORECASE)


def page_violations(tree: ast.AST) -> list[str]:
    """Forbidden imports, SQL text and ``.execute`` calls in one page."""
    out = [f"line {line}: imports {name}" for name, line in _imported_modules(tree)
           if name in PAGE_FORBIDDEN]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.match(node.value):
            out.append(f"line {node.lineno}: SQL text {node.value[:40]!r}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("execute", "executemany", "query")):
            out.append(f"line {node.lineno}: .{node.func.attr}() call")
    return out


def test_pages_exist():
    assert (ROOT / "pages" / "episodes.py").is_file()


@pytest.mark.parametrize("path", _py_files("pages"), ids=lambda p: p.name)
def test_pages_stay_thin(path):
    assert page_violations(_parse(path)) == []


def test_page_checker_catches_violations():
    bad = ast.parse("import pandas as pd\nfrom torch import nn\nimport sqlite_utils.db\n"
                    "q = 'SELECT * FROM episodes'\nws.conn.execute(q)\n")
    found = page_violations(bad)
    assert len(found) == 5, found


# --------------------------------------------------------------------------- html, pickle, markers
def _unsafe_html_calls(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            for kw in node.keywords
            if kw.arg == "unsafe_allow_html"
            and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)]


def test_no_unsafe_html():
    offenders = {str(p.relative_to(ROOT)): lines for p in _py_files("app", "pages", "core")
                 if (lines := _unsafe_html_calls(_parse(p)))}
    assert offenders == {}


def test_unsafe_html_checker():
    assert _unsafe_html_calls(ast.parse("st.markdown(x, unsafe_allow_html=True)")) == [1]
    assert _unsafe_html_calls(ast.parse("st.markdown(x, unsafe_allow_html=False)")) == []


PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}


def _pickle_uses(tree: ast.AST) -> list[str]:
    out = [f"line {line}: imports {name}" for name, line in _imported_modules(tree)
           if name in PICKLERS]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load" and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            safe = any(kw.arg == "weights_only" and isinstance(kw.value, ast.Constant)
                       and kw.value.value is True for kw in node.keywords)
            if not safe:
                out.append(f"line {node.lineno}: torch.load without weights_only=True")
    return out


def test_no_pickle_in_product_code():
    offenders = {str(p.relative_to(ROOT)): found for p in _py_files(*PRODUCT_DIRS)
                 if (found := _pickle_uses(_parse(p)))}
    assert offenders == {}


def test_pickle_checker():
    assert len(_pickle_uses(ast.parse("import pickle\nx = torch.load(f)\n"))) == 2
    assert _pickle_uses(ast.parse("x = torch.load(f, weights_only=True)")) == []


MARKERS = re.compile(r"\b(TODO|FIXME|XXX)\b|\bstubs?\b", re.IGNORECASE)


def test_no_todo_or_stub_markers():
    offenders = []
    for path in _py_files(*PRODUCT_DIRS):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if MARKERS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == []


# --------------------------------------------------------------------------- CLI help
def _walk_commands(command, path=("rwb",)):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk_commands(sub, (*path, name))


def test_every_command_and_option_has_help():
    import typer.main

    from core.cli import root

    group = typer.main.get_command(root)
    missing = []
    n_commands = n_options = 0
    for path, command in _walk_commands(group):
        n_commands += 1
        if not (command.help or command.short_help or "").strip():
            missing.append(" ".join(path))
        for param in command.params:
            # typer vendors its own click: compare by kind, not by click's class
            if param.param_type_name == "option" and not param.hidden:
                n_options += 1
                if not (param.help or "").strip():
                    missing.append(f"{' '.join(path)} {param.opts[0]}")
    assert n_commands >= 3  # rwb, rwb app, rwb workspace …
    assert n_options >= 50  # the walk sees the options (it once saw none)
    assert missing == [], f"commands/options without help text: {missing}"


def test_app_and_workspace_commands_are_wired():
    import typer.main

    from core.cli import root

    commands = typer.main.get_command(root).commands
    assert "app" in commands
    assert {"init", "info"} <= set(commands["workspace"].commands)


# --------------------------------------------------------------------------- CI = README
TEST_COMMAND = ".venv/bin/python -m pytest -q -n auto --dist loadfile"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci_run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_test = (ROOT / ".ci" / "test").read_text(encoding="utf-8")
    assert "bash .ci/test" in readme and "bash .ci/app" in readme
    assert TEST_COMMAND in readme
    assert re.search(rf"^{re.escape(TEST_COMMAND)}$", ci_run, re.MULTILINE)
    assert f"exec {TEST_COMMAND}" in ci_test
    assert "pip install -q torch==2.13.0" in (ROOT / ".ci" / "install").read_text(encoding="utf-8")
    # pytest's "no tests collected" (exit 5) must fail CI.
    assert '"$status" -eq 5' in ci_run


# --------------------------------------------------------------------------- short module docstrings
#: Longest module docstring under core/, in source lines: a summary line, a paragraph on what the
#: module owns and its entry points, and a pointer into docs/ where the rules, formats and worked
#: examples live (docs/style.md: "A module's docstring says what it owns in a paragraph").
MAX_MODULE_DOCSTRING_LINES = 20
#: Modules whose docstring is still longer than that, waiting for their detail to move to docs/.
#: The list only shrinks: a module that comes under the limit must leave it, and no module joins it.
LONG_MODULE_DOCSTRINGS: frozenset[str] = frozenset()


def module_docstring_lines(tree: ast.Module) -> int:
    """Source lines the module docstring spans (0 without one)."""
    first = tree.body[0] if tree.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return first.end_lineno - first.lineno + 1
    return 0


def test_module_docstring_line_counter():
    assert module_docstring_lines(ast.parse('"""One line."""\nx = 1\n')) == 1
    assert module_docstring_lines(ast.parse('"""Summary.\n\nMore.\n"""\n')) == 4
    assert module_docstring_lines(ast.parse('x = 1\n"""not a docstring"""\n')) == 0
    assert module_docstring_lines(ast.parse("")) == 0


def test_module_docstrings_stay_short():
    lengths = {str(p.relative_to(ROOT)): module_docstring_lines(_parse(p)) for p in _py_files("core")}
    assert set(LONG_MODULE_DOCSTRINGS) <= set(lengths), (
        f"allow-listed modules that do not exist: {sorted(set(LONG_MODULE_DOCSTRINGS) - set(lengths))}")
    too_long = {path: n for path, n in lengths.items()
                if n > MAX_MODULE_DOCSTRING_LINES and path not in LONG_MODULE_DOCSTRINGS}
    assert too_long == {}, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: {too_long}; keep a summary, what the "
        "module owns and a 'Details: docs/<file>.md' pointer, and move rules, formats and examples to docs/")
    now_short = {path: lengths[path] for path in LONG_MODULE_DOCSTRINGS
                 if lengths[path] <= MAX_MODULE_DOCSTRING_LINES}
    assert now_short == {}, (
        f"these modules' docstrings are within {MAX_MODULE_DOCSTRING_LINES} lines now: {now_short}; "
        "remove them from LONG_MODULE_DOCSTRINGS")
