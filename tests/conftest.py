"""Suite-wide pytest fixtures and hooks: a fresh workspace per test, the shared tiny
trained run and its bundle (built once per test process), background launches replaced by
``sleep`` children, the fuzz tests' case counts in the terminal summary, and one shared
embedding store for the whole run (``RWB_EMBEDDING_CACHE``, a temporary folder every
worker and every process a test starts inherits, seeded from ``tests/embeddings``): each
distinct text is run through the sentence model once per test run, however many workspaces
embed it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest


#: The shared embedding store this process created (removed when the run ends).
_EMBEDDING_STORE: list[str] = []
#: Packs of the shared store's layout (``<model digest>/<pack>.npy`` + ``.keys``) every run starts with.
SEED_PACKS = Path(__file__).resolve().parent / "embeddings"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes with one thread: the workers already fill the
    cores, and a second intra-op thread per worker only makes them contend (children
    started by tests inherit the setting); files are handed out in collection order.  The
    first process of the run (the controller
    under xdist, which starts the workers after this hook) names the run's shared
    embedding store, unless the caller named one."""
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist hands out whole files (--dist loadfile), by default the files with the
        # most tests first; the collection order (long files first, below) is kept instead
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(name, "1")
    elif not os.environ.get("RWB_EMBEDDING_CACHE"):
        folder = tempfile.mkdtemp(prefix="rwb-test-embeddings-")
        _EMBEDDING_STORE.append(folder)
        # seeded with the packs tests/embeddings/ ships (see its README): texts of the fixtures'
        # generated logs, which every run would otherwise embed again
        shutil.copytree(SEED_PACKS, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.md"))
        os.environ["RWB_EMBEDDING_CACHE"] = folder


#: Test files that take minutes each (a fixture that trains a policy or drives a browser,
#: mypy over core, a whole demo): run first, so that the parallel workers do not end the
#: run waiting on one of them started last (longest first evens out the workers' loads).
LONG_FILES = ("test_browser.py", "test_typing.py", "test_browser_pages.py", "test_demo.py",
              "test_notebooks.py", "test_browser_actions.py", "test_browser_training.py",
              "test_browser_datasets.py", "test_browser_home.py", "test_browser_review.py",
              "test_tuning_policy.py", "test_browser_sessions.py", "test_browser_audit.py",
              "test_browser_tuning.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """The long files' tests first, in :data:`LONG_FILES` order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _EMBEDDING_STORE:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _main_module_restored():
    """Puts back ``sys.modules["__main__"]`` after each test: Streamlit's AppTest runs a page
    as ``__main__`` and can leave it there, and a ``spawn`` child started by a later test in
    the same worker would then run that page again as its own main module."""
    import sys

    main = sys.modules.get("__main__")
    yield
    if main is not None and sys.modules.get("__main__") is not main:
        sys.modules["__main__"] = main


@pytest.fixture
def ws(tmp_path):
    """A fresh workspace in the test's temporary folder (a module may define its own)."""
    from core.records.store import Workspace

    w = Workspace.open(tmp_path / "ws")
    yield w
    w.close()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """The suite's one tiny trained run (tests/_bundle_fixtures.py): a workspace with users,
    150 finance sample episodes, a short PPO run by ``ana`` and its exported bundle, built
    on first use in this test process and then shared by every module that asks.  Tests
    that change its registry use their own policy names, or a copy of the workspace
    (``_bundle_fixtures.trained_copy``)."""
    from _bundle_fixtures import trained

    return trained(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_run) -> Path:
    """The exported bundle of :func:`tiny_run` (a signed zip; never written to)."""
    return tiny_run.bundle


@pytest.fixture
def children(monkeypatch):
    """The background launches of core.rl.runs and core.tuning.workers start ``sleep 120`` instead;
    the children are ended after the test (by their own pids)."""
    import subprocess
    import types

    from core.rl import runs
    from core.tuning import workers

    started: list[subprocess.Popen] = []

    def fake_popen(cmd, **kwargs):
        proc = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        started.append(proc)
        return proc

    fake = types.SimpleNamespace(Popen=fake_popen, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT)
    monkeypatch.setattr(runs, "subprocess", fake)
    monkeypatch.setattr(workers, "subprocess", fake)
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


#: kind of input ("template", "episode file") -> number of generated cases run.
FUZZ_COUNTS: pytest.StashKey[Counter[str]] = pytest.StashKey()


@pytest.fixture(scope="session")
def fuzz_counts(pytestconfig: pytest.Config) -> Counter[str]:
    """A session-wide counter the fuzz tests add their cases to (printed at the end)."""
    return pytestconfig.stash.setdefault(FUZZ_COUNTS, Counter())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    counts = config.stash.get(FUZZ_COUNTS, None)
    if counts:
        terminalreporter.write_line(
            f"fuzz: {counts['template']} template cases ({counts['template refused']} refused), "
            f"{counts['episode file']} episode cases ({counts['episode file refused']} refused)")
