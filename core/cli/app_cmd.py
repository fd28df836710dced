"""``rwb app``: start the Streamlit app on the selected workspace.

The app is ``app/main.py`` of the installed package (an editable install points
into the checkout), served through ``app/asgi.py`` (``st.App`` with the route that sets
the session cookie); Streamlit runs it with usage statistics off.  The workspace
chosen with ``--workspace`` / ``RWB_WORKSPACE`` reaches the app through the
``RWB_WORKSPACE`` environment variable, as an absolute path.  The app's Streamlit
settings (theme, upload size) ship in the package (``rwb_app/.streamlit/config.toml``)
and reach Streamlit as ``STREAMLIT_*`` environment variables, so they hold whatever the
current folder is; a variable already set by the caller wins.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path

import typer

from core.cli import open_workspace
from core.base.errors import RwbError
from core.base.package_data import resource_dir
from core.cli.workspace_cmd import prepare_with_progress


def app_entry() -> Path:
    """``main.py`` of the installed app package (``rwb_app``; ``app/`` in the checkout)."""
    spec = importlib.util.find_spec("rwb_app")
    if spec is None or not spec.submodule_search_locations:
        raise RwbError("the 'rwb_app' package is not installed; reinstall Reward Workbench "
                       "(pip install -e .) from its checkout")
    main = Path(next(iter(spec.submodule_search_locations))) / "main.py"
    if not main.is_file():
        raise RwbError(f"{main} is missing; reinstall Reward Workbench from its checkout")
    return main


def has_display() -> bool:
    """Whether a browser window can be opened here (always on macOS/Windows; X11 or
    Wayland on Linux)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def streamlit_argv(main: Path, *, port: int, host: str, headless: bool) -> list[str]:
    """The ``python -m streamlit run`` command line for ``main``."""
    return [sys.executable, "-m", "streamlit", "run", str(main),
            "--server.port", str(port), "--server.address", host,
            "--server.headless", "true" if headless else "false",
            "--browser.gatherUsageStats", "false"]


def streamlit_settings() -> dict[str, str]:
    """The app's packaged Streamlit settings as Streamlit's environment variables
    (``[theme] primaryColor`` → ``STREAMLIT_THEME_PRIMARY_COLOR``)."""
    path = resource_dir("rwb_app", ".streamlit") / "config.toml"
    settings = tomllib.loads(path.read_text(encoding="utf-8"))
    env = {}
    for section, options in settings.items():
        for key, value in options.items():
            name = "STREAMLIT_" + "_".join(re.sub(r"(?<!^)(?=[A-Z])", "_", part).upper()
                                           for part in (section, key))
            env[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def app_command(
    port: int = typer.Option(8501, "--port", help="Port to serve the app on."),
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to listen on (0.0.0.0 to share on the network)."),
    headless: bool = typer.Option(False, "--headless",
                                  help="Do not open a browser window (servers, CI)."),
    prepare: bool = typer.Option(True, "--prepare/--no-prepare",
                                 help="Before serving, import the sample datasets into an empty "
                                      "workspace and score them, so that every page opens at once "
                                      "(a minute the first time, then a few seconds)."),
) -> None:
    """Start the Reward Workbench app (Streamlit) on the selected workspace."""
    ws = open_workspace()  # creates/migrates it, and refuses a newer schema before serving
    root = ws.root
    if prepare:
        prepare_with_progress(ws)
    ws.close()
    main = app_entry()
    if not headless and not has_display():
        # Without a screen Streamlit would fall back to a terminal browser, if any.
        typer.echo("No display found: not opening a browser (as with --headless).", err=True)
        headless = True
    # asgi.py serves main.py through st.App, with the route that sets the session cookie.
    argv = streamlit_argv(main.with_name("asgi.py"), port=port, host=host, headless=headless)
    env = {**streamlit_settings(), **os.environ, "RWB_WORKSPACE": str(root),
           "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    typer.echo(f"Reward Workbench on http://{host}:{port} — workspace {root}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Replace this process: Ctrl-C and SIGTERM reach Streamlit directly, no orphan server.
    os.execve(sys.executable, argv, env)


def register(root: typer.Typer) -> None:
    """Add the top-level ``app`` command."""
    root.command("app")(app_command)
