"""Suite-wide pytest fixtures and hooks: a fresh workspace per test, the shared tiny
trained run and its bundle (built once per test process), background launches replaced by
``sleep`` children, and the fuzz tests' case counts in the terminal summary."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes with one thread: the workers already fill the
    cores, and a second intra-op thread per worker only makes them contend (children
    started by tests inherit the setting)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(name, "1")


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
