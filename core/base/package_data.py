"""The files Reward Workbench ships beside its code, found through ``importlib.resources``.

The shipped templates and sample datasets live in ``core/bundled/``, the app's pages and
Streamlit settings in the app package (``rwb_app``).  In the checkout those folders are
links to the top-level ``reward_templates/``, ``datasets/<domain>/``, ``pages/`` and
``.streamlit/`` (where people edit them); a wheel carries them as real files inside the
packages.  Both installs, editable and wheel, are found the same way: relative to the
imported package, never through the current folder or the name of site-packages.

Example::

    >>> (templates_dir() / "tool_agent.yaml").is_file()
    True
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from core.base.errors import RwbError

#: The folder of the ``core`` package that holds the shipped data.
BUNDLED = "bundled"


def resource_dir(package: str, *parts: str) -> Path:
    """The folder ``parts`` inside the installed ``package``, as a file-system path.

    Raises :class:`RwbError` when the install lacks it (a wheel built without its data,
    or a package imported from a zip, which cannot hand out folders)."""
    found = resources.files(package)
    for part in parts:
        found = found / part
    if not isinstance(found, Path) or not found.is_dir():
        where = "/".join((package.replace(".", "/"), *parts))
        raise RwbError(f"the installed Reward Workbench has no folder {where}; reinstall it "
                       f"(pip install reward-workbench, or pip install -e . in a checkout)")
    return found


def import_root() -> Path:
    """The folder that holds the ``core`` package (what a child process of this
    interpreter needs on ``PYTHONPATH`` when Reward Workbench was not installed)."""
    return resource_dir("core").parent


def templates_dir() -> Path:
    """The shipped reward templates (``reward_templates/`` in the checkout)."""
    return resource_dir("core", BUNDLED, "reward_templates")


def datasets_dir() -> Path:
    """The shipped sample datasets, one folder per domain (``datasets/<domain>/`` in the
    checkout): tool schemas, mask rules, the sample episodes and their licence."""
    return resource_dir("core", BUNDLED, "datasets")
