"""``rwb app`` as a subprocess for the browser tests: started on a free loopback port,
waited on until Streamlit answers its health check, stopped at the end."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(workspace: Path, log_path: Path, *, env: Mapping[str, str] | None = None,
                start_timeout_s: float = 90) -> Iterator[str]:
    """The app's address while ``rwb --workspace WORKSPACE app --headless`` serves it (its
    output goes to ``log_path``; the test fails with that log if it does not start)."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "rwb"), "--workspace", str(workspace),
                                 "app", "--port", str(port), "--headless"],
                                env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.flush()
                pytest.fail("the app did not start:\n" + log_path.read_text())
            time.sleep(0.3)
        try:
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
