"""``rwb app`` as a subprocess for the browser tests: started on a free loopback port,
waited on until Streamlit answers its health check, stopped at the end."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
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


# --------------------------------------------------------------------------- the browser
#: Debian's Chromium, headless, without a sandbox or background traffic (nothing is downloaded).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


@contextlib.contextmanager
def browser_tab(url: str, *, viewport: Mapping[str, int] | None = None, timeout_ms: int = 120_000) -> Iterator:
    """A Playwright page in the system's Chromium, opened on ``url`` (closed at the end)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=dict(viewport or {"width": 1500, "height": 1100}))
            pg = context.new_page()
            pg.set_default_timeout(timeout_ms)
            pg.goto(url)
            yield pg
            context.close()
        finally:
            browser.close()


# --------------------------------------------------------------------------- plain words
#: A decimal figure as a page writes it (``2.559``, ``-0.0403``, ``1,234.5``): a number
#: with a fractional part, not a part of a dotted name or a version (``finance_risk@1``, ``2.13.0``).
DECIMAL = re.compile(r"(?<![\w.@:/-])-?\d[\d,]*\.\d+(?![\w.])")
#: A command-line flag in what the page shows (commands live in tooltips, see rwb_app.messages).
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
#: Technical names a page must not show bare: it says the plain label, the term goes in a tooltip.
BARE_TERMS = re.compile(r"soft_auc|return_mean|success_rate|off_support_rate|Σγᵗr|\bnats\b|KL\(old|"
                        r"UCB bonus|silhouette -?\d|\brejectd\b")


def significant_digits(figure: str) -> int:
    """Significant digits of a decimal figure as written (``0.0403`` → 3, ``2.5590`` → 5)."""
    return len(figure.lstrip("-").replace(",", "").replace(".", "").lstrip("0"))


def wording_defects(text: str) -> list[str]:
    """What a page's visible text must not hold: a figure with more than 4 significant
    digits, a command-line flag, a technical name without its plain label."""
    found = [f"raw figure {m.group(0)}" for m in DECIMAL.finditer(text) if significant_digits(m.group(0)) > 4]
    found += [f"flag {m.group(0)}" for m in FLAG.finditer(text)]
    found += [f"bare term {m.group(0)}" for m in BARE_TERMS.finditer(text)]
    return found
