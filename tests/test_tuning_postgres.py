"""Distributed tuning: two `rwb tune` workers share one study on a PostgreSQL storage
(Optuna's RDB mode), and optuna-dashboard opens that storage.

The fixture starts a throwaway PostgreSQL cluster on 127.0.0.1 (a free port, a temporary
folder, fsync off) and removes it afterwards.  initdb and postgres refuse to run as root,
so as root they run as the ``postgres`` system user.  The test is skipped only when the
server binaries are absent (``.ci/run`` installs the Debian package ``postgresql``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import optuna
import pytest

from _tuning_fixtures import fin_fast, finance_workspace, write_template
from core import tuning
from core.tuning import CLI, open_rdb
from core.access.users import current_user

ROOT = Path(__file__).resolve().parents[1]
PG_BIN = Path(os.environ.get("RWB_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    if not (PG_BIN / "initdb").is_file() or not (PG_BIN / "pg_ctl").is_file():
        pytest.skip(f"PostgreSQL server binaries not found in {PG_BIN} (Debian package postgresql)")
    as_root = os.geteuid() == 0
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    # not under pytest's tmp folders: those are private to root, and the server runs as postgres
    root = Path(tempfile.mkdtemp(prefix="rwb-pg-"))
    if as_root:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", _free_port()

    def run(*cmd: str) -> None:
        proc = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{cmd[0]} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"

    try:
        run(str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w", "-t", "60", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50", "start")
        run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "rwb")
        yield f"postgresql://postgres@127.0.0.1:{port}/rwb"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*prefix, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                           capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_share_one_study(postgres_url, tmp_path):
    # enough labelled episodes that tuning neither warns nor pulls the weights to the template
    ws = finance_workspace(tmp_path / "ws", n_episodes=240, seed=9)
    template = write_template(fin_fast(), tmp_path / "fin_fast.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RWB_WORKSPACE": str(ws.root)}
    env.pop("RWB_TUNE_STORAGE", None)
    cmd = [*CLI, "tune", "--template", str(template), "--dataset", "fin",
           "--storage", postgres_url, "--study", "shared", "--trials", "12", "--json"]
    workers = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    outputs = [w.communicate(timeout=240) for w in workers]
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [r["trials_run"] for r in results] == [12, 12]
    assert all(not r["warnings"] for r in results)
    storage = open_rdb(postgres_url)       # a bare postgresql:// URL, given the installed driver
    study = optuna.load_study(study_name="shared", storage=storage)
    trials = study.trials
    assert len(trials) == 24 and sorted(t.number for t in trials) == list(range(24))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t.user_attrs["worker"] for t in trials}) == 2           # both workers wrote trials
    assert study.user_attrs["rwb"]["template"]["name"] == "fin_fast"
    best = study.best_trial
    assert max(r["best_value"] for r in results) <= best.value + 1e-12

    # the same storage opens in optuna-dashboard (its WSGI app, one request, no server)
    from wsgiref.util import setup_testing_defaults

    import optuna_dashboard

    app = optuna_dashboard.wsgi(storage)
    environ: dict = {}
    setup_testing_defaults(environ)
    environ.update({"PATH_INFO": "/api/studies", "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()})
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
    assert status[0].startswith("200")
    summaries = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in summaries] == ["shared"]

    # `rwb tune apply` (in process here) reads the shared study through the URL the
    # workspace recorded for it
    applied = tuning.apply_study(ws, current_user(ws), "shared")
    assert applied.label == "fin_fast@1" and applied.trial == best.number
