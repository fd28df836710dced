"""The notebooks in ``notebooks/`` execute top to bottom (nbclient, small data).

Each runs in a kernel whose environment points ``RWB_WORKSPACE`` at a fresh temp
workspace (and ``RWB_POLICIES_DIR`` at a temp folder, so promotion never writes into the
source tree).  The notebooks assert what they demonstrate (expectations pass, the bundle
verifies, decisions are audited), so a broken step fails the test.  Outputs are never
committed: a test checks the files carry none.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# 02_train_review_promote.ipynb did not execute cleanly at the end of session 1 and is
# not shipped yet (issue 8 stays open for it).
EXPECTED = ("01_design_a_reward.ipynb", "03_import_your_own_logs.ipynb")
# Small sizes for the test (each notebook reads these; the defaults are a little larger).
SMALL = {"RWB_NB_EPISODES": "60", "RWB_NB_SESSIONS": "30", "RWB_NB_TRAIN_EPISODES": "120",
         "RWB_NB_TRAIN_STEPS": "8192"}


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_shipped_notebooks_exist():
    names = [p.name for p in _notebooks()]
    for name in EXPECTED:
        assert name in names, f"notebooks/{name} is missing"


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_notebook_has_no_outputs(path: Path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name} cell {i} has committed outputs: strip them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    workspace = tmp_path / "workspace"
    monkeypatch.setenv("RWB_WORKSPACE", str(workspace))
    monkeypatch.setenv("RWB_POLICIES_DIR", str(tmp_path / "policies"))
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the failing cell
    print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s")
    assert (workspace / "workbench.db").is_file(), "the notebook did not use $RWB_WORKSPACE"
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
