"""mypy finds no type error in ``core``.

The configuration is ``[tool.mypy]`` in pyproject.toml: ``core`` as a whole, with the
modules written typed from the start held to strict checking."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_files(pattern: str) -> list[Path]:
    """The files a ``[tool.mypy]`` module pattern names: ``a.b`` one module, ``a.b.*`` a package."""
    if pattern.endswith(".*"):
        return sorted((ROOT / pattern[:-2].replace(".", "/")).rglob("*.py"))
    return [ROOT / (pattern.replace(".", "/") + ".py")]


def test_mypy_finds_no_error_in_core() -> None:
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "core"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_strictly_checked_modules_are_modules_of_core() -> None:
    """The patterns pyproject.toml holds to strict checking name modules of core (which the test
    above checks): a pattern that names nothing would hold nothing to strict checking."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    strict = [o for o in config["overrides"] if o.get("disallow_untyped_defs")]
    assert strict, "no override in [tool.mypy] turns on strict checking"
    patterns = [m for o in strict for m in o["module"]]
    assert "core.base.results" in patterns
    for pattern in patterns:
        files = _module_files(pattern)
        assert files, f"{pattern} names no module of the tree"
        assert all(f.is_file() and f.is_relative_to(ROOT / "core") for f in files), pattern
