"""mypy keeps the modules of ``core`` listed here free of type errors.

The configuration is ``[tool.mypy]`` in pyproject.toml (strict for the modules written
typed from the start).  A module joins :data:`CLEAN` once ``python -m mypy`` reports
nothing in it; the list grows until it is all of ``core``, and then the test checks the
package as a whole."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Modules of core (paths from the repository root) in which mypy finds no error.
CLEAN = [
    "core/__init__.py",
    "core/access/__init__.py",
    "core/access/audit.py",
    "core/access/keys.py",
    "core/access/users.py",
    "core/base/__init__.py",
    "core/base/package_data.py",
    "core/base/results.py",
    "core/base/safe_yaml.py",
    "core/cli/__init__.py",
    "core/cli/__main__.py",
    "core/cli/acting.py",
    "core/cli/app_cmd.py",
    "core/cli/audit.py",
    "core/cli/bundle.py",
    "core/cli/catalog.py",
    "core/cli/datasets.py",
    "core/cli/demo.py",
    "core/cli/episodes.py",
    "core/cli/keys.py",
    "core/cli/registry.py",
    "core/cli/review.py",
    "core/cli/reward.py",
    "core/cli/reward_versions.py",
    "core/cli/serve.py",
    "core/cli/states.py",
    "core/cli/train.py",
    "core/cli/tune.py",
    "core/cli/users.py",
    "core/cli/workspace_cmd.py",
    "core/data/__init__.py",
    "core/data/datagen/__init__.py",
    "core/data/datagen/common.py",
    "core/data/datasets.py",
    "core/data/episode_views.py",
    "core/data/importers/__init__.py",
    "core/data/importers/api.py",
    "core/data/importers/chat.py",
    "core/data/importers/openai.py",
    "core/data/importers/rwb.py",
    "core/govern/__init__.py",
    "core/govern/bundle.py",
    "core/govern/policy_folder.py",
    "core/govern/registry.py",
    "core/govern/registry_records.py",
    "core/guard/__init__.py",
    "core/guard/review.py",
    "core/policies/__init__.py",
    "core/records/__init__.py",
    "core/records/store.py",
    "core/rewards/__init__.py",
    "core/rewards/agent_signals.py",
    "core/rewards/cache.py",
    "core/rewards/calibration.py",
    "core/rewards/expectations.py",
    "core/rewards/pyramid.py",
    "core/rl/__init__.py",
    "core/rl/agent.py",
    "core/rl/checkpoints.py",
    "core/rl/common.py",
    "core/rl/env.py",
    "core/rl/loading.py",
    "core/rl/ppo.py",
    "core/rl/rde.py",
    "core/rl/rollouts.py",
    "core/rl/sim.py",
    "core/sample/__init__.py",
    "core/sample/warmup.py",
    "core/sample/workspace_setup.py",
    "core/serve/__init__.py",
    "core/serve/fast_policy.py",
    "core/state/__init__.py",
    "core/tuning/__init__.py",
    "core/tuning/apply.py",
    "core/tuning/labels.py",
    "core/tuning/objectives.py",
    "core/tuning/preferences.py",
    "core/tuning/problem.py",
    "core/tuning/reweighting.py",
    "core/tuning/statistics.py",
]


def test_the_clean_modules_exist() -> None:
    missing = [m for m in CLEAN if not (ROOT / m).is_file()]
    assert not missing, f"listed in CLEAN but not in the tree: {missing}"


def test_mypy_finds_no_error_in_the_clean_modules() -> None:
    pytest.importorskip("mypy")
    # silent: the modules these import are read for their types, their own errors are not reported
    done = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary",
                           *CLEAN], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_strictly_checked_modules_are_kept_clean() -> None:
    """The modules pyproject.toml holds to strict checking are among those this test runs mypy on."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    strict = [o for o in config["overrides"] if o.get("disallow_untyped_defs")]
    assert strict, "no override in [tool.mypy] turns on strict checking"
    paths = [m.replace(".", "/") + ".py" for o in strict for m in o["module"]]
    assert "core/base/results.py" in paths
    assert not [p for p in paths if (ROOT / p).is_file() and p not in CLEAN]
