"""The HTTP decision service (core.serve.serve_http, ``rwb serve http``).

The end-to-end tests run the real command — uvicorn on a free port, in its own process —
against the promoted tiny policy ``svc`` (tests/_bundle_fixtures.py) and talk to it with
httpx: decide, batch, health, readiness, metrics, OpenAPI, refused requests, the bearer
token, audit records equal to in-process ones, and a promotion and a rollback picked up
without a restart.  Faster checks of the app run in this process with FastAPI's TestClient.
The served process embeds with the hash embedder the tiny policy was trained with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from _bundle_fixtures import module_hash_embedder, promote_svc, trained_copy  # noqa: F401
from _http_server import free_port, ready, started
from _state_fixtures import HashEmbedder
from core.access import audit
from core.govern import registry
from core.serve import serve_http
from core.serve.serving import Decision, DecisionEngine, ServingConfig
from core.records.store import DB_NAME, Workspace
from core.access.users import LOCAL_ADMIN

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: `rwb ...` with the hash embedder in place of the sentence model (what the policy was trained with).
RWB = ("import sys, core.base.embed; core.base.embed.workspace_embedder = lambda _ws: core.base.embed.HashEmbedder(); "
       "from core.cli import main; sys.exit(main(sys.argv[1:]))")
#: Deterministic engine settings for comparing with in-process decisions: RL-Boost waits for
#: the query's embedding and is never cut short by a busy machine.
DETERMINISTIC = ["--wait-for-intent", "--budget-ms", "20000"]

STATE = {"hour": 10, "minute": 30, "market_open": 1, "volatility": 0.12, "position": 20000,
         "position_weight": 0.2, "cash": 900000.0, "portfolio_value": 4000000.0, "leverage": 1.1,
         "trades_today": 0}


def _request(episode: str, task_type: str = "analysis", **state) -> dict:
    return {"episode_id": episode, "query": "Analyse the Q3 report of Kweichow Moutai 600519 for me",
            "task_type": task_type, "state": {**STATE, **state}}


#: New episodes of every kind: the tree alone, other task types, and one far out of distribution
#: (RL-Boost runs on it).
REQUESTS = [_request("a1"), _request("a2", "urgent_reduce"), _request("a3", volatility=80.0),
            _request("a4", "analysis", hour=20, trades_today=3)]


def trust_run_key(target: Workspace, run) -> None:
    """Let ``target`` trust the key the shared run's workspace signs with (``rwb keys trust``)."""
    from core.access import keys

    source = run.workspace()
    pem = Path(target.root) / "run-signing-key.pem"
    pem.write_text(keys.show(source).public_key_pem)
    source.close()
    keys.trust(target, LOCAL_ADMIN, pem)


def _trusting_workspace(path: Path, run) -> Path:
    ws = Workspace.open(path)
    trust_run_key(ws, run)
    ws.close()
    return path


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_copy(tmp_path_factory)  # its own registry: test_serving.py registers "svc" too


@pytest.fixture(scope="module")
def promoted(run, tmp_path_factory):
    """A policies folder with ``svc`` 0.1.0 promoted and 0.2.0 approved, through the registry."""
    return promote_svc(run, tmp_path_factory.mktemp("http-policies"))


class Server:
    """``rwb serve http`` in its own process."""

    def __init__(self, proc: subprocess.Popen, url: str, workspace: Path, info: dict):
        self.proc, self.url, self.workspace, self.info = proc, url, workspace, info
        self.client = httpx.Client(base_url=url, timeout=60.0)

    def decide(self, request: dict, headers: dict | None = AUTH) -> httpx.Response:
        return self.client.post("/v1/decide", json=request, headers=headers)


@pytest.fixture(scope="module")
def server(run, promoted, tmp_path_factory):
    work = tmp_path_factory.mktemp("http-prod")
    prod = _trusting_workspace(work / "prod", run)  # the deployment trusts the promoting workspace's key
    port = free_port()
    env = {**os.environ, "RWB_POLICIES_DIR": str(promoted), "RWB_WORKSPACE": str(prod),
           "RWB_SERVE_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    with started([sys.executable, "-c", RWB, "serve", "http", "--policy", "svc", "--port", str(port),
                  *DETERMINISTIC, "--json"], port=port, env=env, log=work / "server.log") as running:
        srv = Server(running.proc, running.url, prod, running.info)
        yield srv
        srv.client.close()


def _audit_records(path: Path, decision_ids: set[str]) -> list[audit.AuditRecord]:
    """The audit records of the workspace at ``path`` once those of ``decision_ids`` are
    committed (the service commits in batches every 0.5 s)."""
    deadline = time.monotonic() + 20
    while True:
        ws = Workspace.open(path)
        records = audit.list_records(ws, limit=10_000, newest_first=False)
        ws.close()
        if decision_ids <= {r.decision_id for r in records} or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


# --------------------------------------------------------------------------- end to end
def test_decide_batch_health_and_readiness(server):
    assert server.info["policy_version"] == "svc@0.1.0" and server.info["token_required"] is True
    assert server.client.get("/healthz").json() == {"status": "ok"}
    probe = ready(server.client, timeout=20.0)
    assert probe.status_code == 200, probe.text
    assert probe.json()["ready"] is True and probe.json()["policy_version"] == "svc@0.1.0"
    assert probe.json()["checks"] == {"policy_loaded": True, "embedder_warm": True, "audit_writable": True}

    r = server.decide(_request("e2e-1"))
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == {f.name for f in dataclasses.fields(Decision)}
    assert (d["episode_id"], d["step_t"], d["policy_version"]) == ("e2e-1", 0, "svc@0.1.0")
    assert d["source"] in ("rde", "policy", "fallback") and isinstance(d["final_action"], int)
    # the episode goes on: the next request is its second step
    assert server.decide(_request("e2e-1")).json()["step_t"] == 1

    b = server.client.post("/v1/decide/batch", json={"requests": [_request("e2e-b1"), _request("e2e-b2")]},
                           headers=AUTH)
    assert b.status_code == 200, b.text
    assert [x["episode_id"] for x in b.json()["decisions"]] == ["e2e-b1", "e2e-b2"]
    ids = {d["decision_id"]} | {x["decision_id"] for x in b.json()["decisions"]}
    assert ids <= {r.decision_id for r in _audit_records(server.workspace, ids)}


def test_bad_requests_get_422_naming_the_field_and_the_server_stays_up(server):
    r = server.decide({"episode_id": "bad", "query": "q", "state": {"hour": [9, 10]}})
    assert r.status_code == 422
    assert r.json()["field"] == "state.hour" and "state.hour" in r.json()["message"]
    r = server.decide({"episode_id": "bad", "query": "q", "colour": "red"})
    assert r.status_code == 422 and r.json()["field"] == "colour" and "unknown field" in r.json()["message"]
    r = server.client.post("/v1/decide", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["message"]
    # two steps of one episode in one batch: the engine refuses it, naming the request
    r = server.client.post("/v1/decide/batch", json={"requests": [_request("dup"), _request("dup")]}, headers=AUTH)
    assert r.status_code == 422 and (r.json()["field"], r.json()["record"]) == ("episode_id", 1)
    r = server.client.post("/v1/decide/batch", json={"requests": [_request("ok"), {"episode_id": "x"}]},
                           headers=AUTH)
    assert r.status_code == 422 and (r.json()["field"], r.json()["record"]) == ("query", 1)
    assert server.client.get("/healthz").status_code == 200
    assert server.decide(_request("after-422")).status_code == 200


def test_the_token_guards_the_decide_endpoints(server):
    r = server.decide(_request("tok"), headers=None)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert server.decide(_request("tok"), headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert server.client.post("/v1/decide/batch", json={"requests": [_request("tok")]}).status_code == 401
    assert server.decide(_request("tok")).status_code == 200
    # probes and metrics stay open
    assert server.client.get("/readyz").status_code == 200 and server.client.get("/metrics").status_code == 200


def test_metrics_move_with_decisions(server):
    before = _samples(server.client.get("/metrics").text)
    decisions = [server.decide(r).json() for r in REQUESTS]
    after_text = server.client.get("/metrics")
    assert after_text.headers["content-type"].startswith("text/plain")
    after = _samples(after_text.text)
    assert _total(after, "rwb_decisions_total") - _total(before, "rwb_decisions_total") == len(REQUESTS)
    assert (_total(after, "rwb_decision_latency_seconds_count")
            - _total(before, "rwb_decision_latency_seconds_count")) == len(REQUESTS)
    assert (_total(after, "rwb_http_requests_total", endpoint="decide", status="200")
            - _total(before, "rwb_http_requests_total", endpoint="decide", status="200")) == len(REQUESTS)
    assert _total(after, "rwb_http_request_duration_seconds_count", endpoint="decide") >= len(REQUESTS)
    # earlier tests were refused: the refusals are counted by reason
    assert _total(after, "rwb_http_errors_total", reason="invalid_request") >= 4
    assert _total(after, "rwb_http_errors_total", reason="unauthorized") >= 3
    assert any(d["rl_boost"] for d in decisions)
    share = after[("rwb_rl_boost_share", (("policy_version", "svc@0.1.0"),))]
    assert 0.0 < share <= 1.0
    assert after[("rwb_policy_active", (("policy_version", "svc@0.1.0"),))] == 1.0
    for name in ("rwb_rde_overrides_total", "rwb_review_queue_pushes_total", "rwb_rl_boost_activations_total"):
        assert any(n == name for n, _ in after) or name.removesuffix("_total") in after_text.text


def test_openapi_lists_the_endpoints_and_the_request_schema(server):
    spec = server.client.get("/openapi.json").json()
    assert {"/v1/decide", "/v1/decide/batch", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])
    body = spec["paths"]["/v1/decide"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/DecisionRequest")
    schemas = spec["components"]["schemas"]
    assert {"episode_id", "query", "state", "last_result"} <= set(schemas["DecisionRequest"]["properties"])
    assert set(schemas["DecisionOut"]["properties"]) == {f.name for f in dataclasses.fields(Decision)}
    assert {"401", "422", "503"} <= set(spec["paths"]["/v1/decide"]["post"]["responses"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


def test_audit_records_equal_the_in_process_ones(run, promoted, server, tmp_path):
    served = [server.decide({**r, "episode_id": "aud-" + r["episode_id"]}).json() for r in REQUESTS]
    ws = Workspace.open(_trusting_workspace(tmp_path / "inproc", run))
    engine = DecisionEngine.from_policy(ws, "svc", root=promoted, embedder=HashEmbedder(),
                                        config=ServingConfig(wait_for_intent=True, time_budget_ms=20000))
    local = [engine.decide({**r, "episode_id": "aud-" + r["episode_id"]}) for r in REQUESTS]
    engine.close()
    mine = {r.episode_id: r.to_dict() for r in audit.list_records(ws, newest_first=False)}
    ws.close()
    ids = {d["decision_id"] for d in served}
    theirs = {r.episode_id: r.to_dict() for r in _audit_records(server.workspace, ids) if r.decision_id in ids}
    assert set(theirs) == set(mine) == {"aud-" + r["episode_id"] for r in REQUESTS}
    for eid, rec in theirs.items():
        ref = mine[eid]
        assert list(rec) == list(ref)
        for key in ("input_hash", "rde_action", "final_action", "policy_version", "episode_id"):
            assert rec[key] == ref[key], (eid, key)
        assert [c["id"] for c in rec["rl_candidates"]] == [c["id"] for c in ref["rl_candidates"]]
        for got, want in zip(rec["rl_candidates"] + rec["reward_components"],
                             ref["rl_candidates"] + ref["reward_components"]):
            assert {k: pytest.approx(v, rel=1e-5, abs=1e-6) if isinstance(v, float) else v
                    for k, v in got.items()} == want
    assert [d["final_action"] for d in served] == [d.final_action for d in local]
    assert any(r["rl_candidates"] for r in theirs.values())


def test_a_promotion_and_a_rollback_are_picked_up_without_restart(run, promoted, server):
    """Runs after the others that decide: it changes what the policies folder serves."""
    assert server.decide(_request("hs-old")).json()["policy_version"] == "svc@0.1.0"
    w = run.workspace()
    registry.promote(w, run.actor("bob"), "svc", "0.2.0", root=promoted)
    assert server.decide(_request("hs-new")).json()["policy_version"] == "svc@0.2.0"
    # the running episode finishes on the version it started with
    assert server.decide(_request("hs-old")).json()["policy_version"] == "svc@0.1.0"
    assert server.client.get("/readyz").json()["policy_version"] == "svc@0.2.0"
    metrics = _samples(server.client.get("/metrics").text)
    assert metrics[("rwb_policy_active", (("policy_version", "svc@0.2.0"),))] == 1.0
    assert metrics[("rwb_policy_reloads_total", (("result", "loaded"),))] == 1.0
    registry.rollback(w, run.actor("bob"), "svc", "0.2.0 misbehaves", root=promoted)
    w.close()
    assert server.decide(_request("hs-after-rollback")).json()["policy_version"] == "svc@0.1.0"
    assert server.decide(_request("hs-new")).json()["policy_version"] == "svc@0.2.0"
    assert server.proc.poll() is None


def test_the_service_stops_cleanly_and_commits_its_audit_records(server):
    """After every other end-to-end test: SIGINT stops the service with exit code 0, and every
    decision it answered has its audit record."""
    answered = _total(_samples(server.client.get("/metrics").text), "rwb_decisions_total")
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0
    ws = Workspace.open(server.workspace)
    assert audit.stats(ws).records == answered
    ws.close()


# --------------------------------------------------------------------------- in process
@pytest.fixture()
def app_ws(run, tmp_path):
    return _trusting_workspace(tmp_path / "app-ws", run)


def _app(run, ws_path, **options):
    config = serve_http.service_config(wait_for_intent=True, model_process=False)
    return serve_http.create_app(str(run.bundle), workspace=ws_path, config=config, embedder=HashEmbedder(),
                                 **options)


def test_in_process_app_without_token_and_the_batch_limit(run, app_ws):
    with TestClient(_app(run, app_ws, max_batch=2)) as client:
        r = client.post("/v1/decide", json=_request("tc-1"))
        assert r.status_code == 200 and r.json()["policy_version"] == "finance_risk@0.1.0"
        serve_http.DecisionOut.model_validate(r.json())
        three = {"requests": [_request(f"tc-{i}") for i in range(3)]}
        r = client.post("/v1/decide/batch", json=three)
        assert r.status_code == 422 and r.json()["field"] == "requests" and "at most 2" in r.json()["message"]
        assert client.post("/v1/decide/batch", json={"requests": []}).status_code == 422
    ws = Workspace.open(app_ws)
    assert audit.stats(ws).records == 1   # committed when the app shut down
    ws.close()


def test_readiness_fails_while_the_audit_trail_cannot_be_written(run, app_ws, monkeypatch):
    monkeypatch.setattr(serve_http, "AUDIT_PROBE_TIMEOUT_S", 0.05)
    with TestClient(_app(run, app_ws)) as client:
        assert ready(client).status_code == 200
        blocker = sqlite3.connect(app_ws / DB_NAME, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            r = client.get("/readyz")
            assert r.status_code == 503 and r.json()["checks"]["audit_writable"] is False
            assert "not writable" in r.json()["problems"][0]
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert ready(client).status_code == 200


def test_settings_travel_through_the_environment_to_a_worker(run, app_ws, monkeypatch):
    """``--workers N`` starts each worker with ``create_app()`` and the settings in env vars."""
    settings = serve_http.ServiceSettings(policy=str(run.bundle), workspace=str(app_ws), token="tkn", max_batch=7,
                                          config=serve_http.service_config(review_risks=("high", "medium"),
                                                                           model_process=False))
    assert serve_http.ServiceSettings.from_env(settings.to_env()) == settings
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    with TestClient(serve_http.create_app()) as client:
        assert client.post("/v1/decide", json=_request("env-1")).status_code == 401
        r = client.post("/v1/decide", json=_request("env-1"), headers={"Authorization": "Bearer tkn"})
        assert r.status_code == 200
        assert client.app.state.service.settings == settings


def test_cli_refuses_an_unknown_policy_before_serving(tmp_path, capsys):
    from core.cli import main

    code = main(["--workspace", str(tmp_path / "w"), "serve", "http", "--policy", str(tmp_path / "none.zip")])
    assert code == 2 and "no bundle at" in capsys.readouterr().err


def test_cli_serves_with_the_collector_frozen_and_run_between_requests(tmp_path, monkeypatch, capsys):
    from core.cli import main

    for name in serve_http.ServiceSettings(policy="p").to_env():  # the CLI sets them for its workers
        monkeypatch.delenv(name, raising=False)
    ran = []
    monkeypatch.setattr("core.serve.serve_http.check_policy", lambda settings: "svc@0.1.0")
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.append((app, kw)))
    code = main(["--workspace", str(tmp_path / "w"), "serve", "http", "--policy", "svc", "--workers", "2"])
    assert code == 0 and ran and ran[0][0] == "core.serve.serve_http:create_app"
    config = json.loads(os.environ[serve_http.ENV_CONFIG])
    assert config["freeze_gc"] is True and config["idle_gc"] is True   # a serving process's settings
    assert "svc@0.1.0" in capsys.readouterr().out
