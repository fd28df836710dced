#!/usr/bin/env bash
# Release check: build the sdist and wheel, check them with twine, install the wheel into a
# fresh virtual environment outside the source tree and use it there as a new user would.
#
#   bash .ci/wheel_smoke.sh        # needs .venv (bash .ci/install) for build and twine
#
# The base install must do everything but the app without streamlit or plotly (they are
# not installed there, so an import of either fails a step); `[app]` then serves the app.
# Only `core` and `rwb_app` may land in site-packages: no generic `app`, `pages` or
# `datasets` package.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="$(pwd)"
PYTHON="${PYTHON:-python3.11}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rwb-wheel-smoke.XXXXXX")"
case "$WORK/" in "$SRC"/*) echo "the smoke folder $WORK is inside the source tree" >&2; exit 1 ;; esac
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
START=$SECONDS
step() { echo "== wheel smoke [$((SECONDS - START)) s]: $*"; }

step "build the sdist and the wheel (isolated build: the declared build requirements)"
# From a copy of the checkout: a build writes into its source folder (egg-info, an unpacked
# sdist), and the test suite builds from the checkout at the same time.
.venv/bin/python - "$SRC" "$WORK/src" <<'EOF_COPY'
import shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2], symlinks=True, ignore=shutil.ignore_patterns(
    ".git", ".venv", "workspace", "demo-workspace", "test-output", "__pycache__", "*.egg-info", "build",
    "dist", ".hypothesis", ".pytest_cache", ".mypy_cache", ".ruff_cache"))
EOF_COPY
.venv/bin/python -m build --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
.venv/bin/python -m twine check --strict "$WORK"/dist/*
WHEEL="$(ls "$WORK"/dist/*.whl)"

step "fresh virtual environment in $WORK/venv: torch==2.13.0, then the wheel (base)"
"$PYTHON" -m venv "$WORK/venv"
VENV="$WORK/venv"
# --no-compile: byte-compiling torch and friends is most of an install's time on 2 cores.
pip_install() { "$VENV/bin/python" -m pip install -q --no-compile "$@" > "$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }; }
pip_install torch==2.13.0
pip_install "$WHEEL"
mkdir "$WORK/cwd"
cd "$WORK/cwd"  # nothing of the checkout is importable from here
RWB="$VENV/bin/rwb"

step "only core and rwb_app in site-packages; neither streamlit nor plotly in the base install"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util
import sysconfig
from pathlib import Path

site = Path(sysconfig.get_paths()["purelib"])
ours = {Path(str(f)).parts[0] for f in md.files("reward-workbench")}
ours = {p for p in ours if not p.endswith(".dist-info") and p != ".."}
assert ours == {"core", "rwb_app"}, f"top-level entries of the wheel: {sorted(ours)}"
generic = [n for n in ("app", "pages", "datasets") if (site / n).exists() or (site / f"{n}.py").exists()]
assert not generic, f"generic top-level packages in site-packages: {generic}"
for extra_only in ("streamlit", "plotly", "fastapi"):
    assert importlib.util.find_spec(extra_only) is None, f"{extra_only} is installed by the base install"
print("site-packages:", sorted(ours), "(no app, pages, datasets; no streamlit, plotly, fastapi)")
EOF

step "rwb --version, rwb reward show tool_agent"
"$RWB" --version | grep -qx "rwb $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("reward-workbench"))')"
"$RWB" reward show tool_agent > "$WORK/reward.txt"
grep -q "tool_agent" "$WORK/reward.txt"

step "train a tiny run on generated finance episodes, export it as a bundle"
SAMPLE="$("$VENV/bin/python" -c 'from core.data.datasets import sample_files; print(sample_files()[0])')"
case "$SAMPLE" in "$VENV"/*) ;; *) echo "the sample is read from $SAMPLE, not from the install" >&2; exit 1 ;; esac
"$RWB" datasets generate --domain finance --episodes 24 --seed 1 --out "$WORK/finance.jsonl" > /dev/null
"$RWB" --workspace "$WORK/ws" train --template finance_risk --episodes "$WORK/finance.jsonl" --steps 512 --device cpu \
  --set n_envs=16 --set rollout_len=16 --set n_minibatches=2 --set 'encoder={"dim": 32}' --set hidden=32 \
  --set bc_epochs=1 --set threads=1 --quiet --json > "$WORK/train.json"
RUN_ID="$("$VENV/bin/python" -c 'import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); assert r["status"]=="finished", r; print(r["run_id"])' "$WORK/train.json")"
"$RWB" --workspace "$WORK/ws" bundle export "$RUN_ID" --out "$WORK/policy.zip" --json > "$WORK/bundle.json"
"$RWB" --workspace "$WORK/ws" bundle verify "$WORK/policy.zip" --json > /dev/null

step "rwb demo --small"
"$RWB" demo --small --dir "$WORK/demo" > "$WORK/demo.txt" 2>&1 || { tail -40 "$WORK/demo.txt"; exit 1; }

step "install the [app] extra; rwb app serves the app"
pip_install "$WHEEL[app]"
RWB_WORKSPACE="$WORK/demo" "$VENV/bin/python" - <<'EOF'
# The router runs from the install: its pages and settings come from the package.
from importlib import resources

from streamlit.testing.v1 import AppTest

main = resources.files("rwb_app") / "main.py"
at = AppTest.from_file(str(main), default_timeout=120).run()
assert not at.exception, [e.message for e in at.exception]
print("app router ran from", main)
EOF
PORT="$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$RWB" --workspace "$WORK/demo" app --headless --port "$PORT" > "$WORK/app.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/_stcore/health" > /dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$WORK/app.log"; echo "rwb app stopped" >&2; exit 1; fi
  sleep 1
done
[ "$(curl -sf "http://127.0.0.1:$PORT/_stcore/health")" = "ok" ] || { cat "$WORK/app.log"; exit 1; }
# (to a file first: with pipefail, grep -q closing the pipe early would fail curl)
curl -sf "http://127.0.0.1:$PORT/" -o "$WORK/page.html" || { cat "$WORK/app.log"; exit 1; }
grep -qi "<html" "$WORK/page.html" || { cat "$WORK/app.log"; echo "the app's page is not HTML" >&2; exit 1; }

step "passed in $((SECONDS - START)) s"
