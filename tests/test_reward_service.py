"""The HTTP reward service (core.serve.reward_service, ``rwb reward serve``).

End to end: the real command — uvicorn on a free loopback port, in its own process, one per
module — answers OpenRLHF's ``/get_reward``, NeMo Gym's ``/verify`` and the batch ``/v1/score``
with exactly what ``TrajectoryScorer.score_batch`` gives in this process for the same
trajectories (recorded AgentDojo runs, a Hermes-markup transcript, Responses API items), and
refuses what it must (422 naming the field, 401, 413).  Both sides embed with the hash embedder
(deterministic, no model to load: the served process gets it through the ``-c`` wrapper below),
so the scores agree to the last bit; one more service, plain ``rwb reward serve``, serves the
real sentence model and is checked against the in-process scorer with the same model.  Faster checks of the app run in this process with
FastAPI's TestClient.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from _http_server import free_port, ready, started
from core.base.embed import HashEmbedder
from core.rewards.markup import transcript_messages
from core.rewards.trajectory import TrajectoryScorer, episode_messages
from core.serve import reward_service
from core.serve.reward_service import EmbeddingLRU, RewardSettings, chat_tools, responses_messages, reward_app

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "reward-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: `rwb ...` with the hash embedder behind the service's embedding cache (no sentence model).
RWB = ("import sys, core.base.embed as e; e.Embedder.reader = lambda self, **kw: e.HashEmbedder(); "
       "from core.cli import main; sys.exit(main(sys.argv[1:]))")
MAX_BATCH = 16
MAX_BODY_MB = 1.0

CRITERIA = {"expected_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
            "communicate": ["21 degrees"]}
WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def hermes(call: str, answer: str = "It is sunny in Paris, 21 degrees.") -> str:
    """A decoded ChatML transcript with a Hermes tool call (what OpenRLHF sends as a query)."""
    return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
            f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nSunny, 21 degrees\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\n{answer}<|im_end|>")


GOOD_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BROKEN_CALL = '{"name": "get_weather", "arguments": {"city": '


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def episodes() -> list[dict]:
    """Six recorded AgentDojo runs as trajectories (episode_messages of the imported episodes)."""
    from core.data.importers.api import read_file

    lines = (ROOT / "datasets" / "real" / "agentdojo" / "episodes.jsonl").read_text().splitlines()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"rwb-reward-service-{os.getpid()}.jsonl"
    path.write_text("\n".join(lines[::97][:6]) + "\n")
    try:
        parsed = read_file(path, reward_key="success", id_key="eid")
    finally:
        path.unlink()
    return [{"messages": episode_messages(ep), "id": ep.episode_id} for ep in parsed.episodes]


@pytest.fixture(scope="module")
def scorer() -> TrajectoryScorer:
    """The in-process reference: the same template, the same (hash) embeddings."""
    return TrajectoryScorer("tool_agent", embedder=HashEmbedder())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``rwb reward serve`` in its own process (one worker), with a token file."""
    work = tmp_path_factory.mktemp("reward-serve")
    (work / "token").write_text(TOKEN + "\n")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RWB_WORKSPACE": str(work / "no-workspace")}
    env.pop("RWB_REWARD_TOKEN", None)
    with started([sys.executable, "-c", RWB, "reward", "serve", "--template", "tool_agent", "--port", str(port),
                  "--workers", "1", "--token-file", str(work / "token"), "--max-batch", str(MAX_BATCH),
                  "--max-body-mb", str(MAX_BODY_MB), "--json"], port=port, env=env, log=work / "server.log") as srv:
        with httpx.Client(base_url=srv.url, timeout=60.0) as client:
            srv.client = client  # type: ignore[attr-defined]
            yield srv


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# --------------------------------------------------------------------------- end to end
def test_start_health_readiness_and_openapi(server, scorer):
    assert server.info == {"url": server.url, "template": "tool_agent@0", "sha256": scorer.sha256, "workers": 1,
                           "token_required": True, "max_batch": MAX_BATCH}
    assert server.client.get("/healthz").json() == {"status": "ok"}
    probe = ready(server.client)
    assert probe.status_code == 200, probe.text
    assert probe.json() == {"ready": True, "template": "tool_agent@0", "sha256": scorer.sha256,
                            "checks": {"scorer_warm": True}, "problems": []}
    spec = server.client.get("/openapi.json").json()
    assert {"/get_reward", "/verify", "/v1/score", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert {"ScoreRequest", "TrajectoryIn", "RewardRequest", "VerifyRequest", "ScoreOut", "RewardOut"} <= set(schemas)
    assert "422" in spec["paths"]["/v1/score"]["post"]["responses"]


def test_a_batch_scores_exactly_as_the_in_process_scorer(server, scorer, episodes):
    with_task = {"messages": transcript_messages(hermes(GOOD_CALL)), "tools": WEATHER_TOOLS, "task": CRITERIA,
                 "id": "weather"}
    batch = [*episodes, with_task]
    r = server.client.post("/v1/score", json={"trajectories": batch}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["template"], body["sha256"]) == ("tool_agent@0", scorer.sha256)
    assert body["scores"] == [s.to_dict() for s in scorer.score_batch(batch)]
    assert [s["id"] for s in body["scores"]] == [e["id"] for e in batch]
    # each trajectory on its own: alone, it scores what it scored in the batch
    alone = server.client.post("/v1/score", json={"trajectories": [episodes[2]]}, headers=AUTH).json()
    assert alone["scores"][0] == body["scores"][2]


def test_get_reward_answers_openrlhf(server, scorer):
    queries = [hermes(GOOD_CALL), hermes(GOOD_CALL, "I could not find out."), hermes(BROKEN_CALL)]
    labels = [json.dumps({"task": CRITERIA, "tools": WEATHER_TOOLS}), CRITERIA, None]
    r = server.client.post("/get_reward", json={"query": queries, "prompts": ["p"] * 3, "labels": labels},
                           headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = scorer.score_batch([
        {"messages": transcript_messages(queries[0]), "task": CRITERIA, "tools": WEATHER_TOOLS},
        {"messages": transcript_messages(queries[1]), "task": CRITERIA},
        {"messages": transcript_messages(queries[2])}])
    assert body["rewards"] == body["scores"] == [s.score for s in expected]
    assert body["rewards"][0] > body["rewards"][2]   # the unreadable call is an INVALID action, not a crash
    applies_to_all = [c for c in scorer.component_names if all(s.components[c] is not None for s in expected)]
    assert set(body["extra_logs"]) == set(applies_to_all) | {f"level/{k}" for k in expected[0].levels}
    for name in applies_to_all:
        assert body["extra_logs"][name] == [s.components[name] for s in expected]
    # no labels at all (older OpenRLHF sends the query alone)
    alone = server.client.post("/get_reward", json={"query": queries[2:]}, headers=AUTH).json()
    assert alone["rewards"] == body["rewards"][2:]


def test_verify_answers_nemo_gym_and_plain_messages(server, scorer):
    params = {"input": [{"role": "user", "content": "What is the weather in Paris?"}],
              "tools": [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                         "parameters": WEATHER_TOOLS[0]["function"]["parameters"], "strict": True}]}
    response = {"id": "resp_1", "object": "response", "output": [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees"},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "It is sunny in Paris, 21 degrees.", "annotations": []}]}]}
    r = server.client.post("/verify", json={"responses_create_params": params, "response": response,
                                            "task": CRITERIA, "expected_call": {"name": "get_weather"}}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    chat = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny, 21 degrees"},
            {"role": "assistant", "content": "It is sunny in Paris, 21 degrees."}]
    expected = scorer.score(chat, tools=WEATHER_TOOLS, task=CRITERIA)
    assert body["reward"] == expected.score
    assert body["reward_components"] == {k: v for k, v in expected.components.items() if v is not None}
    assert body["responses_create_params"] == params and body["response"] == response   # echoed, as NeMo Gym's
    assert body["expected_call"] == {"name": "get_weather"}                               # other keys too
    assert all(body[k] == v for k, v in body["reward_components"].items())               # top-level numbers
    assert (body["reward_template"], body["reward_template_sha256"]) == ("tool_agent@0", scorer.sha256)

    plain = server.client.post("/verify", json={"messages": chat, "tools": WEATHER_TOOLS, "task": CRITERIA},
                               headers=AUTH).json()
    assert plain["reward"] == expected.score and plain["reward_components"] == body["reward_components"]


def test_refusals_name_the_field(server, episodes):
    bad = [*episodes[:3], {"messages": "not a list"}]
    r = server.client.post("/v1/score", json={"trajectories": bad}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "trajectories[3].messages", r.text
    call = {"id": "c", "type": "function", "function": {"name": "", "arguments": {}}}
    unnamed = {"messages": [{"role": "assistant", "content": "", "tool_calls": [call]}]}
    r = server.client.post("/v1/score", json={"trajectories": [episodes[0], unnamed]}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "trajectories[1].messages[0].tool_calls[0].function.name"
    r = server.client.post("/v1/score", json={"trajectories": [episodes[0]] * (MAX_BATCH + 1)}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "trajectories"
    assert f"at most {MAX_BATCH}" in r.json()["message"]
    r = server.client.post("/get_reward", json={"query": ["q"], "labels": ["{not json"]}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"].startswith("labels[0]")
    r = server.client.post("/get_reward", json={"query": ["a", "b"], "labels": [None]}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "labels"
    r = server.client.post("/get_reward", json={"query": [hermes(GOOD_CALL)], "labels": [{"task": "text"}]},
                           headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "labels[0].task", r.text
    nemo = {"responses_create_params": {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 3}]},
            "response": {"output": [{"type": "message", "role": "assistant", "content": "hello"}]}}
    r = server.client.post("/verify", json=nemo, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "responses_create_params.tools[0]", r.text
    r = server.client.post("/verify", json={"tools": []}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "messages"
    r = server.client.post("/v1/score", content=b'{"trajectories": [',
                           headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["message"]


def test_the_token_and_the_body_size_are_checked_before_the_body(server, episodes):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = server.client.post("/v1/score", json={"trajectories": episodes[:1]}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
    assert server.client.get("/healthz").status_code == 200   # the probes need no token
    cap = int(MAX_BODY_MB * 1024 * 1024)
    big = json.dumps({"trajectories": [{"messages": [{"role": "user", "content": "x" * (cap + 10)}]}]}).encode()
    r = server.client.post("/v1/score", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and f"at most {cap:,}" in r.json()["message"]

    def chunks():  # no Content-Length: cut when it passes the cap
        for _ in range(cap // 65536 + 2):
            yield b" " * 65536

    with httpx.Client(base_url=server.url, timeout=60.0) as fresh:
        r = fresh.post("/v1/score", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413


def test_metrics_count_requests_trajectories_and_component_means(server, scorer, episodes):
    before = _samples(server.client.get("/metrics").text)
    server.client.post("/v1/score", json={"trajectories": episodes[:2]}, headers=AUTH).raise_for_status()
    after = _samples(server.client.get("/metrics").text)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("rwb_reward_http_requests_total", endpoint="score", status="200") == 1
    assert grew("rwb_reward_trajectories_scored_total", endpoint="score") == 2
    assert grew("rwb_reward_http_request_duration_seconds_count", endpoint="score") == 1
    assert grew("rwb_reward_score_count") == 2
    component = scorer.component_names[0]
    assert grew("rwb_reward_component_count", component=component) == 2
    assert after[("rwb_reward_template_info", (("sha256", scorer.sha256), ("template", "tool_agent@0")))] == 1
    assert after[("rwb_reward_http_requests_total", (("endpoint", "score"), ("status", "422")))] >= 3
    assert after[("rwb_reward_http_errors_total", (("endpoint", "score"), ("reason", "unauthorized")))] >= 3
    assert after[("rwb_reward_http_errors_total", (("endpoint", "score"), ("reason", "too_large")))] >= 2
    assert after[("rwb_reward_embedding_cache_texts", ())] > 0
    assert grew("rwb_reward_embedding_encoded_total") == 0   # the texts were embedded by an earlier request


def test_the_service_stops_cleanly(server):
    """After every other end-to-end test: SIGINT stops the service with exit code 0."""
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0


# --------------------------------------------------------------------------- in process
def test_readiness_waits_for_the_warm_up():
    app = reward_app(TrajectoryScorer("tool_agent", embedder=HashEmbedder()), warm=False)
    with TestClient(app) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["problems"] == ["the sentence model is still loading"]
        app.state.service.warm()
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics").text
    assert 'rwb_reward_http_requests_total{endpoint="readyz",status="503"} 1.0' in metrics


def test_components_that_do_not_apply_are_left_out_not_zeroed():
    """With a criteria template, a trajectory without task criteria has those components null in
    /v1/score, absent from /verify's reward_components, and out of /get_reward's extra_logs."""
    scorer = TrajectoryScorer("tool_agent_criteria", embedder=HashEmbedder())
    queries = [hermes(GOOD_CALL), hermes(GOOD_CALL)]
    expected = scorer.score_batch([{"messages": transcript_messages(q), **extra}
                                   for q, extra in zip(queries, ({"task": CRITERIA}, {}))])
    criteria_only = {c for c in scorer.component_names if expected[1].components[c] is None}
    assert criteria_only and all(expected[0].components[c] is not None for c in criteria_only)
    with TestClient(reward_app(scorer, warm=False)) as client:
        body = client.post("/get_reward", json={"query": queries, "labels": [CRITERIA, ""]}).json()
        assert body["rewards"] == [s.score for s in expected]
        assert not criteria_only & set(body["extra_logs"])
        verified = client.post("/verify", json={"messages": transcript_messages(queries[1])}).json()
        assert set(verified["reward_components"]) == set(scorer.component_names) - criteria_only
        scored = client.post("/v1/score", json={"trajectories": [{"messages": transcript_messages(queries[1])}]}).json()
        assert all(scored["scores"][0]["components"][c] is None for c in criteria_only)


def test_the_embedding_cache_is_bounded_and_answers_as_its_source():
    source = HashEmbedder()
    lru = EmbeddingLRU(source, max_texts=3)
    texts = ["a b", "c d", "a b", "e f", None]
    out = lru.encode(texts)
    assert (out == source.encode(["a b", "c d", "a b", "e f", ""])).all()
    assert lru.stats == {"hits": 1, "encoded": 4} and len(lru) == 3   # "a b" embedded once; the oldest dropped
    lru.encode(["e f", ""])
    assert lru.stats == {"hits": 3, "encoded": 4}
    lru.warm_up()   # a source without a warm-up is fine


def test_responses_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c2", "output": {"ok": True}},
             {"type": "reasoning", "summary": []}]
    assert responses_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "name": "g", "content": '{"ok": true}'}]
    assert chat_tools([{"type": "function", "name": "f", "parameters": {}, "strict": True},
                       {"type": "web_search"}, WEATHER_TOOLS[0]]) == [
        {"type": "function", "function": {"name": "f", "parameters": {}}}, WEATHER_TOOLS[0]]


def test_settings_travel_through_the_environment_to_a_worker(monkeypatch):
    settings = RewardSettings(template="tool_agent@0", sha256="ab" * 32, token="tkn", max_batch=7,
                              max_body_bytes=4096)
    assert RewardSettings.from_env(settings.to_env()) == settings
    with pytest.raises(Exception, match="empty"):
        RewardSettings(template="tool_agent", token=" ")
    for name, value in {**settings.to_env(), reward_service.ENV_SHA256: TrajectoryScorer("tool_agent").sha256}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(reward_service.ENV_WORKSPACE, raising=False)
    monkeypatch.setattr("core.base.embed.Embedder.reader", lambda self, **kw: HashEmbedder())
    import gc

    try:
        with TestClient(reward_service.app_from_env()) as client:
            assert client.post("/v1/score", json={"trajectories": [{"messages": [{"role": "user", "content": "hi"}]}]}
                               ).status_code == 401
            r = client.post("/v1/score", json={"trajectories": [{"messages": [{"role": "user", "content": "hi"}]}] * 8},
                            headers={"Authorization": "Bearer tkn"})
            assert r.status_code == 422 and r.json()["field"] == "trajectories"
            r = client.post("/v1/score", content=b"[" + b" " * 5000 + b"]",
                            headers={"Authorization": "Bearer tkn", "Content-Type": "application/json"})
            assert r.status_code == 413
            assert ready(client).status_code == 200
            assert gc.get_freeze_count() > 0      # a worker's app moves what is alive after its warm-up out of reach
    finally:
        gc.unfreeze()   # the collector is process-wide: leave this test process's as it was


def test_cli_hands_several_workers_a_factory_and_the_pinned_settings(tmp_path, monkeypatch):
    from core.cli import main

    for name in RewardSettings(template="t").to_env() | {reward_service.ENV_SHA256: "", reward_service.ENV_TOKEN: ""}:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "token").write_text("from-a-file\n")
    ran = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.append((app, kw)))
    assert main(["--workspace", str(tmp_path / "ws"), "reward", "serve", "--template", "tool_agent",
                 "--workers", "3", "--port", "8611", "--token-file", str(tmp_path / "token")]) == 0
    app, kw = ran[0]
    assert app == "core.serve.reward_service:app_from_env" and kw["factory"] is True and kw["workers"] == 3
    assert os.environ[reward_service.ENV_TEMPLATE] == "tool_agent@0"
    assert os.environ[reward_service.ENV_SHA256] == TrajectoryScorer("tool_agent").sha256
    assert os.environ[reward_service.ENV_TOKEN] == "from-a-file"
    assert main(["reward", "serve", "--template", "no_such_template"]) == 2   # a usage error, no traceback


# --------------------------------------------------------------------------- the sentence model itself
def test_the_real_sentence_model_serves_what_it_scores_in_process(tmp_path, episodes):
    """Plain ``rwb reward serve`` (the real sentence model, loaded offline): ready once the model is
    warm, and its scores are the in-process scorer's with the same model (to float32 rounding:
    the two processes embed the texts in batches of other sizes)."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RWB_WORKSPACE": str(tmp_path / "no-workspace")}
    env.pop("RWB_REWARD_TOKEN", None)
    batch = [*episodes, {"messages": transcript_messages(hermes(GOOD_CALL)), "tools": WEATHER_TOOLS,
                         "task": CRITERIA, "id": "weather"}]
    expected = TrajectoryScorer("tool_agent").score_batch(batch)
    assert any(s.components["answer_consistency"] not in (0.0, None) for s in expected)  # the model was read
    with started([sys.executable, "-m", "core.cli", "reward", "serve", "--template", "tool_agent", "--port",
                  str(port), "--json"], port=port, env=env, log=tmp_path / "server.log") as srv:
        with httpx.Client(base_url=srv.url, timeout=120.0) as client:
            assert ready(client, timeout=120.0).status_code == 200
            got = client.post("/v1/score", json={"trajectories": batch}).json()["scores"]
            reward = client.post("/get_reward", json={"query": [hermes(GOOD_CALL)], "prompts": [""],
                                                      "labels": [CRITERIA]}).json()
    for want, have in zip(expected, got):
        assert have["score"] == pytest.approx(want.score, abs=1e-5)
        for name, value in want.components.items():
            assert have["components"][name] == (None if value is None else pytest.approx(value, abs=1e-5))
    weather = TrajectoryScorer("tool_agent").score(transcript_messages(hermes(GOOD_CALL)), task=CRITERIA)
    assert reward["rewards"] == [pytest.approx(weather.score, abs=1e-5)]
