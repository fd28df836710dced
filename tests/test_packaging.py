"""The release artefacts: the wheel and sdist carry the shipped data, install only ``core``
and ``rwb_app``, and keep the app's dependencies out of the base install.

The wheel is built here (``python -m build --no-isolation``: sdist first, then the wheel
from the unpacked sdist, as a release is built); ``.ci/wheel_smoke.sh`` installs it into a
fresh environment and uses it."""

from __future__ import annotations

import email
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from core.base import package_data
from core.base.embed_store import packaged_model_digest
from core.data.datasets import SAMPLES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,), (sdist,) = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    return wheel, sdist


@pytest.fixture(scope="module")
def wheel_files(dists) -> dict[str, bytes]:
    with zipfile.ZipFile(dists[0]) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _shipped() -> dict[str, Path]:
    """Wheel path -> checkout file, for everything the wheel must carry as data."""
    want = {f"core/bundled/reward_templates/{p.name}": p for p in (ROOT / "reward_templates").glob("*.yaml")}
    for spec in SAMPLES:
        folder = ROOT / "datasets" / spec.domain
        want |= {f"core/bundled/datasets/{spec.domain}/{p.relative_to(folder).as_posix()}": p
                 for p in folder.rglob("*") if p.is_file()}   # the sample's embeddings store among them
    want |= {f"rwb_app/page_scripts/{p.name}": p for p in (ROOT / "pages").glob("*.py")}
    want |= {f"rwb_app/static/{p.name}": p for p in (ROOT / "app" / "static").iterdir()}
    want["rwb_app/.streamlit/config.toml"] = ROOT / ".streamlit" / "config.toml"
    return want


def test_the_wheel_carries_templates_samples_pages_static_and_settings(wheel_files):
    want = _shipped()
    assert {"core/bundled/reward_templates/tool_agent.yaml", "core/bundled/datasets/finance/sample.jsonl",
            "core/bundled/datasets/ecommerce/tools.json", "rwb_app/page_scripts/episodes.py",
            *(f"core/bundled/datasets/{domain}/embeddings/{packaged_model_digest()[:32]}/sample.{kind}"
              for domain in ("finance", "ecommerce") for kind in ("npy", "keys")),
            "rwb_app/static/reward_pyramid.png", "rwb_app/.streamlit/config.toml"} <= set(want)
    missing = sorted(set(want) - set(wheel_files))
    assert not missing, missing
    differ = sorted(name for name, path in want.items() if wheel_files[name] != path.read_bytes())
    assert not differ, differ


def test_the_wheel_installs_only_core_and_rwb_app(wheel_files):
    top = {name.split("/")[0] for name in wheel_files if ".dist-info/" not in name}
    assert top == {"core", "rwb_app"}
    top_level = next(data for name, data in wheel_files.items() if name.endswith(".dist-info/top_level.txt"))
    assert top_level.decode().split() == ["core", "rwb_app"]
    # every package of the checkout is in the wheel (the packages list in pyproject.toml is explicit)
    for init in [*(ROOT / "core").rglob("__init__.py"), ROOT / "app" / "__init__.py"]:
        rel = init.relative_to(ROOT).as_posix()
        assert ("rwb_app/" + rel.removeprefix("app/") if rel.startswith("app/") else rel) in wheel_files


def test_the_wheel_leaves_out_tests_and_the_real_logs(wheel_files):
    assert not [n for n in wheel_files if n.startswith(("tests/", "benchmarks/", "notebooks/", "datasets/"))]
    assert not [n for n in wheel_files if "/real/" in n or "test_" in n.rsplit("/", 1)[-1]]
    assert sum(len(data) for data in wheel_files.values()) < 12_000_000  # the real logs alone are 22 MB


def test_the_base_install_needs_neither_streamlit_nor_plotly(wheel_files):
    metadata = next(data for name, data in wheel_files.items() if name.endswith(".dist-info/METADATA"))
    requires = email.message_from_bytes(metadata).get_all("Requires-Dist")
    base = {r.split(";")[0].split(">")[0].split("[")[0].strip().lower() for r in requires if "extra ==" not in r}
    assert "torch" in base and not base & {"streamlit", "plotly", "fastapi", "uvicorn", "psycopg", "psycopg2-binary"}

    def extra(name: str) -> set[str]:
        return {r.split(";")[0].split(">")[0].split("[")[0].strip().lower() for r in requires
                if f'extra == "{name}"' in r}

    assert extra("app") == {"streamlit", "plotly"}
    assert extra("http") == {"fastapi", "uvicorn"}
    assert "psycopg" in extra("postgres")


def test_the_sdist_holds_the_data_as_files(dists):
    with tarfile.open(dists[1]) as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if "/" in m.name}
    for name in ("core/bundled/reward_templates/finance_risk.yaml", "core/bundled/datasets/finance/masks.yaml",
                 "app/page_scripts/tuning.py", "app/.streamlit/config.toml", "pyproject.toml"):
        assert members[name].isfile(), name  # a file, not a link into a folder the sdist lacks
    assert not [n for n in members if n.startswith("datasets/")]


def test_the_checkout_links_the_shipped_folders():
    """In the checkout (an editable install) the package folders are the top-level ones."""
    assert package_data.templates_dir().resolve() == ROOT / "reward_templates"
    for spec in SAMPLES:
        assert (package_data.datasets_dir() / spec.domain).resolve() == ROOT / "datasets" / spec.domain
    assert sorted(p.name for p in package_data.datasets_dir().iterdir()) == sorted(s.domain for s in SAMPLES)
    assert package_data.resource_dir("rwb_app", "page_scripts").resolve() == ROOT / "pages"
    assert (package_data.resource_dir("rwb_app", ".streamlit") / "config.toml").resolve() == \
        ROOT / ".streamlit" / "config.toml"
    assert package_data.import_root() == Path(__import__("core").__file__).resolve().parents[1]


def test_a_missing_folder_is_a_reinstall_message():
    from core.base.errors import RwbError

    with pytest.raises(RwbError, match="no folder core/bundled/nothing; reinstall"):
        package_data.resource_dir("core", "bundled", "nothing")


def test_core_works_with_streamlit_and_plotly_absent():
    """What production imports and the CLI commands of the base install load neither
    (a module set to None in sys.modules fails to import, as when it is not installed)."""
    code = """
import sys
sys.modules.update(streamlit=None, plotly=None)
import core.rewards.views, core.state.statemap, core.tuning.studies, core.serve.serving, core.govern.bundle, core.sample.demo, core.rl.runs
from core.cli import main
sys.exit(main(["reward", "show", "tool_agent"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "name: tool_agent" in proc.stdout


def test_the_app_settings_reach_streamlit_as_its_variables():
    from core.cli.app_cmd import streamlit_settings

    env = streamlit_settings()
    assert env["STREAMLIT_THEME_PRIMARY_COLOR"] == "#1f6f8b"
    assert env["STREAMLIT_SERVER_MAX_UPLOAD_SIZE"] == "1024"
    assert env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] == "false"
    from streamlit import config

    known = {option.env_var for option in config.get_config_options().values()}
    assert set(env) <= known
