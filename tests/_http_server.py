"""A real HTTP service for the end-to-end tests: an ``rwb`` command that runs uvicorn, in its own
process, on a free loopback port (``rwb serve http``: tests/test_serve_http.py,
tests/test_serve_bounds.py; ``rwb reward serve``: tests/test_reward_service.py)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Started:
    """A service process that answers ``/healthz``."""

    proc: subprocess.Popen
    port: int
    url: str
    #: Its first line on stdout (the start-up line; parsed when it is JSON).
    first_line: str
    log: Path

    @property
    def info(self) -> Any:
        return json.loads(self.first_line)

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def started(argv: Sequence[str], *, port: int, env: Mapping[str, str], log: Path,
            timeout_s: float = 60.0) -> Iterator[Started]:
    """Run ``argv`` (a command that serves on ``port``; stderr to ``log``), wait for its start-up
    line and for ``/healthz`` to answer 200, yield it, then stop it with SIGINT (a graceful
    shutdown, as Ctrl-C)."""
    out = open(log, "w")
    proc = subprocess.Popen(list(argv), cwd=ROOT, env=dict(env), stdout=subprocess.PIPE, stderr=out, text=True)
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        srv = Started(proc, port, f"http://127.0.0.1:{port}", first, log)
        assert first, f"the service did not start: {srv.log_tail()}"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=srv.url, timeout=10.0) as probe:
            while True:
                try:
                    if probe.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, srv.log_tail()
                time.sleep(0.1)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.close()


def ready(client: Any, timeout: float = 30.0) -> Any:
    """The readiness probe's answer once it is 200 (or the last one after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.get("/readyz")
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)
