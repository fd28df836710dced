"""Time to usable of every page of the app, in a real browser, first and second open.

Starts ``rwb app`` on a fresh folder (so the start imports the sample datasets and
prepares the workspace, see :mod:`core.sample.warmup`), then opens the root address and every
page by its address in Debian's Chromium (Playwright, headless), twice, and prints a
table and the worst page.  With ``--reference`` it measures the same on another fresh
folder started with ``--no-prepare`` (the app as it was: the first visit imports the
samples and the Reward Pyramid page scores them itself).

**Usable** means, all at once and still so 200 ms later: Streamlit's app element says
the script is not running (``data-test-script-state="notRunning"``), the page's title is
shown as its heading (``h1``), and nothing is stale (``data-stale``), loading
(``stSpinner``, ``stSkeleton``) or failed (``stException``).  The time runs from the
navigation's start to the first of the two checks.

Run (an idle machine gives the figures the README quotes; the machine may be shared, so
``load`` prints the 1-minute load average at start)::

    .venv/bin/python benchmarks/bench_pages.py [--reference] [--rounds 2] [--json]

``app_pages``, ``start_app``, ``open_usable`` and ``UsablePage`` are importable (the
browser test of every page, tests/test_browser_pages.py, reuses them).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
VIEWPORT = {"width": 1500, "height": 1100}

#: What "usable" checks in the page (see the module docstring).
USABLE_JS = """(title) => {
  const app = document.querySelector('[data-testid="stApp"]');
  if (!app || app.getAttribute('data-test-script-state') !== 'notRunning') return false;
  const main = document.querySelector('[data-testid="stMain"]');
  if (!main) return false;
  const heading = [...main.querySelectorAll('h1')].some(h => h.innerText.trim().startsWith(title));
  if (!heading) return false;
  if (document.querySelector('[data-stale="true"]')) return false;
  if (document.querySelector('[data-testid="stStatusWidget"]')) return false;
  for (const id of ['stSpinner', 'stSkeleton']) {
    if ([...document.querySelectorAll(`[data-testid="${id}"]`)].some(e => e.offsetParent !== null)) return false;
  }
  return true;
}"""
FAILED_JS = """() => !!document.querySelector('[data-testid="stMain"] [data-testid="stException"]')"""


@dataclass(frozen=True)
class AppPage:
    """One page of the app's menu: its title (the page's heading) and address."""

    title: str
    url_path: str


def app_pages() -> list[AppPage]:
    """The pages ``app/main.py`` registers (its ``PAGES`` and ``SIGN_IN_PAGE`` literals),
    in menu order, so that a new page is measured without editing this file."""
    tree = ast.parse((ROOT / "app" / "main.py").read_text(encoding="utf-8"))
    found: dict[str, object] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in ("PAGES", "SIGN_IN_PAGE") and node.value is not None:
            found[target.id] = ast.literal_eval(node.value)
    rows = [*found["PAGES"], found["SIGN_IN_PAGE"]]  # type: ignore[misc]
    return [AppPage(title=title, url_path=url) for _file, title, url, _icon in rows]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningApp:
    url: str
    #: Seconds from the command's start until Streamlit answered its health check (the
    #: workspace preparation included).
    start_seconds: float
    log: Path
    process: subprocess.Popen


@contextmanager
def start_app(workspace: Path, *, prepare: bool = True, log: Path | None = None,
              timeout: float = 1800.0, env: dict[str, str] | None = None) -> Iterator[RunningApp]:
    """``rwb --workspace WORKSPACE app --headless`` on a free port, until its health check
    answers (the preparation runs before that); stopped on exit."""
    port = free_port()
    log = log or workspace.parent / f"app-{port}.log"
    cmd = [str(Path(sys.executable).parent / "rwb"), "--workspace", str(workspace), "app",
           "--port", str(port), "--headless", *([] if prepare else ["--no-prepare"])]
    out = open(log, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the app did not start:\n{log.read_text()}")
            time.sleep(0.25)
        yield RunningApp(url, time.monotonic() - t0, log, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


@contextmanager
def browser_page(viewport: dict[str, int] | None = None):
    """A Playwright page in the system's Chromium (headless, no sandbox, nothing downloaded)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise RuntimeError("Debian's chromium is not installed (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport=viewport or VIEWPORT)
        try:
            yield context.new_page()
        finally:
            context.close()
            browser.close()


@dataclass
class UsablePage:
    """One open of one page."""

    title: str
    url_path: str
    seconds: float
    #: CPU seconds the app's server process spent meanwhile (user + system): what the open
    #: costs, nearly independent of other work on a shared machine.
    server_cpu: float | None = None
    #: CPU seconds the browser's processes spent meanwhile (loading scripts, drawing charts).
    browser_cpu: float | None = None
    #: The page showed an exception (its time is when it did).
    failed: bool = False


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def browser_cpu_seconds(server_pid: int | None) -> float | None:
    """CPU seconds so far of this process's descendants but the app server: Playwright's
    driver and the browser (a finished process no longer counts: compare close readings)."""
    try:
        import psutil
    except ImportError:
        return None
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        if child.pid == server_pid:
            continue
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def open_usable(pg, url: str, page: AppPage, *, timeout: float = 300.0,
                server_pid: int | None = None, via_sidebar: bool = False) -> UsablePage:
    """Open ``page`` by its address (``via_sidebar``: by a click on its link in the sidebar
    of the page already shown) and wait until it is usable (module docstring); with
    ``server_pid``, also count the CPU seconds of the server and of the browser meanwhile."""
    cpu0 = cpu_seconds(server_pid) if server_pid else None
    browser0 = browser_cpu_seconds(server_pid)
    t0 = time.monotonic()
    if via_sidebar:
        # a person's click: the app stays loaded, Streamlit switches the page (no reload)
        pg.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=page.title, exact=True).click()
        pg.wait_for_function("(title) => ![...document.querySelectorAll('[data-testid=\"stMain\"] h1')]"
                             ".some(h => h.innerText.trim().startsWith(title)) || true", arg=page.title)
    else:
        pg.goto(f"{url}/{page.url_path}", wait_until="commit")
    deadline = t0 + timeout
    while True:
        now = time.monotonic()
        if pg.evaluate(FAILED_JS):
            return UsablePage(page.title, page.url_path, now - t0, _spent(server_pid, cpu0),
                              _browser_spent(server_pid, browser0), failed=True)
        if pg.evaluate(USABLE_JS, page.title):
            pg.wait_for_timeout(200)
            if pg.evaluate(USABLE_JS, page.title):
                return UsablePage(page.title, page.url_path, now - t0, _spent(server_pid, cpu0),
                                  _browser_spent(server_pid, browser0))
        if now > deadline:
            raise TimeoutError(f"{page.title} was not usable after {timeout:.0f} s")
        pg.wait_for_timeout(50)


def _spent(pid: int | None, before: float | None) -> float | None:
    after = cpu_seconds(pid) if pid else None
    return None if after is None or before is None else round(after - before, 2)


def _browser_spent(server_pid: int | None, before: float | None) -> float | None:
    after = browser_cpu_seconds(server_pid)
    return None if after is None or before is None else round(after - before, 2)


def measure(workspace: Path, *, prepare: bool, rounds: int) -> dict:
    """Start the app on ``workspace`` and open every page ``rounds`` times, in menu order."""
    pages = app_pages()
    # The root address first: a person's very first visit, sent on to the first page.
    pages = [AppPage(pages[0].title, ""), *pages]
    with start_app(workspace, prepare=prepare) as app, browser_page() as pg:
        opens = [[asdict(open_usable(pg, app.url, p, server_pid=app.process.pid)) for p in pages]
                 for _ in range(rounds)]
        log = app.log.read_text(errors="replace")
    return {"prepare": prepare, "start_seconds": round(app.start_seconds, 2), "opens": opens,
            "prepared_lines": sum(line.startswith("Preparing the workspace") for line in log.splitlines())}


def _table(result: dict, label: str) -> str:
    opens = result["opens"]
    lines = [f"{label}: `rwb app` ready after {result['start_seconds']:.1f} s",
             f"  {'address':<16}" + "".join(f"{'open ' + str(i + 1):>10}" for i in range(len(opens)))
             + "".join(f"{'server ' + str(i + 1):>10}" for i in range(len(opens)))
             + "".join(f"{'browser ' + str(i + 1):>10}" for i in range(len(opens)))
             + "  page (seconds to usable; CPU seconds of the server and the browser)"]
    for row in zip(*opens):
        marks = "".join(f"{o['seconds']:>9.2f}{'!' if o['failed'] else ' '}" for o in row)
        for key in ("server_cpu", "browser_cpu"):
            marks += "".join(f"{'-' if o[key] is None else format(o[key], '.2f'):>9} " for o in row)
        lines.append(f"  {'/' + row[0]['url_path']:<16}{marks}  {row[0]['title']}")
    worst = max(opens[0], key=lambda o: o["seconds"])
    lines.append(f"  worst first open: {worst['title']} {worst['seconds']:.2f} s"
                 + (f"; worst later open: {max(o['seconds'] for r in opens[1:] for o in r):.2f} s"
                    if len(opens) > 1 else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="opens of every page (default 2)")
    parser.add_argument("--reference", action="store_true",
                        help="also measure the app started with --no-prepare (minutes more)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    out: dict = {"load_1min": os.getloadavg()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-pages-") as tmp:
        out["prepared"] = measure(Path(tmp) / "prepared", prepare=True, rounds=args.rounds)
        if args.reference:
            out["reference"] = measure(Path(tmp) / "reference", prepare=False, rounds=args.rounds)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"load average {out['load_1min']:.2f} on {out['cpus']} CPUs (! = the page showed an error)")
    print(_table(out["prepared"], "prepared at start"))
    if "reference" in out:
        print(_table(out["reference"], "reference (--no-prepare)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
