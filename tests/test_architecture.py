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

    def module_of(name: str) -> str:  # core.rewards.views -> core.rewards
        return ".".join(name.split(".")[:2])

    arrows: dict[str, set[str]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = module_of(importer), module_of(imported)
            if a != b:
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
    assert len(arrows) > 20  # the graph was really read
