"""Import what the pages need when the server starts, so that no first visit waits for it.

Streamlit runs a page's script only when someone opens it; the first page to use
pandas, plotly or a ``core`` module then pays for importing it (a second or two of CPU
each time a new server starts).  :func:`lifespan` is the server's start-up hook
(``st.App(..., lifespan=lifespan)`` in ``asgi.py``): it imports every module the page
scripts and :mod:`rwb_app.resources` import, before the server accepts connections.

Modules that load torch are left out (:data:`SKIP`): only an action (mapping states,
diagnosing or evaluating a run) needs them, and torch would make every server larger.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The modules whose imports are preloaded: the page scripts and the app's own modules.
SOURCES = (HERE / "page_scripts", HERE / "resources.py", HERE / "charts.py", HERE / "messages.py")
#: Imported by Streamlit itself when a page first shows a table or a chart.
RENDERING = ("pandas", "pyarrow", "plotly.graph_objects", "plotly.io")
#: Modules that load torch: imported on the first action that needs them, not at start.
SKIP = frozenset({"core.state.features", "core.state.statemap", "core.rl.doctor", "core.rl.evaluation"})


def _imported_names(path: Path) -> set[str]:
    """Every absolute module an import statement in ``path`` names (``from core import x``
    names ``core.x`` when that is a module), at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def preload_modules() -> list[str]:
    """The modules :func:`preload` imports, sorted: ``core`` and ``rwb_app`` modules the
    sources import (not :data:`SKIP`), and :data:`RENDERING`."""
    files = [f for src in SOURCES for f in (sorted(src.glob("*.py")) if src.is_dir() else [src])]
    wanted = set(RENDERING)
    for name in set().union(*(_imported_names(f) for f in files)):
        skipped = any(name == s or name.startswith(s + ".") for s in SKIP)
        if name.split(".")[0] in ("core", "rwb_app") and not skipped and _is_module(name):
            wanted.add(name)
    return sorted(wanted)


def _is_module(name: str) -> bool:
    # find_spec imports the parent package: SKIP is checked before.
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # "core.base.errors.InputError": a parent is not a package
        return False


def preload() -> list[str]:
    """Import :func:`preload_modules`; returns them."""
    names = preload_modules()
    for name in names:
        importlib.import_module(name)
    return names


@asynccontextmanager
async def lifespan(_app: Any) -> AsyncIterator[None]:
    """``st.App``'s start-up hook: preload, then serve."""
    preload()
    yield
