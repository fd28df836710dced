"""Suite-wide pytest fixtures and hooks: a fresh workspace per test, background launches
replaced by ``sleep`` children, and the fuzz tests' case counts in the terminal summary."""

from __future__ import annotations

import os
from collections import Counter

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


@pytest.fixture
def children(monkeypatch):
    """The background launches of core.rl.runs and core.tuning.studies start ``sleep 120`` instead;
    the children are ended after the test (by their own pids)."""
    import subprocess
    import types

    from core.rl import runs
    from core.tuning import studies as tuning

    started: list[subprocess.Popen] = []

    def fake_popen(cmd, **kwargs):
        proc = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        started.append(proc)
        return proc

    fake = types.SimpleNamespace(Popen=fake_popen, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT)
    monkeypatch.setattr(runs, "subprocess", fake)
    monkeypatch.setattr(tuning, "subprocess", fake)
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
