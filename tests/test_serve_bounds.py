"""Every request is bounded before it is read (issue 28, attacks 6–9).

6. The HTTP service checks the bearer token and the body's size from the headers before it
   reads a byte: 50 MB bodies without a token are answered 401 while the server's memory
   stays flat; a body over the cap is answered 413, declared or chunked.
7. Every request field has a length limit, the same in-process (``InputError`` naming the
   field) and over HTTP (422 in the documented ``ErrorOut`` shape naming the field).
8. Nesting in ``messages`` and ``last_result.result`` is measured before anything recurses
   into it: 33 to 100,000 levels are refused as above, never a 500 or an undocumented 400.
9. A batch is atomic: a bad request or a refused audit write leaves no audit record and no
   advanced episode; the retry without the bad request starts every episode at step 0.

Each refusal writes a ``request_refused`` security event (rate-limited: ``RefusalLog``).
The HTTP tests run the real ``rwb serve http`` (uvicorn, its own process) on the tiny bundle,
as tests/test_serve_http.py does.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from _bundle_fixtures import module_hash_embedder, trained_copy  # noqa: F401
from _state_fixtures import HashEmbedder
from _http_server import free_port, started
from test_serve_http import AUTH, DETERMINISTIC, RWB, TOKEN, _request, _trusting_workspace
from core.access import audit
from core.access.audit import AuditUnavailable, AuditWriter
from core.base.errors import InputError
from core.govern.bundle import load_bundle
from core.records.store import Workspace
from core.serve import serve_http, serving
from core.serve.serving import DecisionEngine, RefusalLog, ServingConfig

MB = 1_000_000


def _deep(levels: int) -> dict:
    """``{"a": {"a": …}}`` nested ``levels`` objects deep (built without recursion)."""
    top = node = {}
    for _ in range(levels - 1):
        node["a"] = {}
        node = node["a"]
    return top


def _deep_json(levels: int) -> str:
    return '{"a":' * (levels - 1) + "{}" + "}" * (levels - 1)


#: Over-long fields, each with the field the refusal names (in-process and over HTTP: 3 MB,
#: over every field's limit and under the body cap; a longer body is refused unread, 413).
LONG_FIELDS = [
    ({"messages": [{"role": "user", "content": "x" * (3 * MB)}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 200_000}] * 6}, "messages"),   # 1.2 MB in all
    ({"messages": [{"role": "user", "content": "hi"}] * 1_001}, "messages"),
    ({"task_type": "x" * (3 * MB)}, "task_type"),
    ({"domain": "x" * (3 * MB)}, "domain"),
    ({"query": "x" * (3 * MB)}, "query"),
    ({"episode_id": "x" * 100_000}, "episode_id"),
    ({"state": {f"f{i}": i for i in range(100_000)}}, "state"),
    ({"state": {"k" * 10_000: 1}}, "state"),
    ({"state": {"note": "x" * (3 * MB)}}, "state"),
    ({"last_result": {"tool": "get_quote", "result": {"page": "x" * (3 * MB)}}}, "last_result.result"),
    ({"last_result": {"tool": "get_quote", "result": "x" * (3 * MB)}}, "last_result.result"),
    ({"last_result": {"tool": "get_quote", "error": "x" * (3 * MB)}}, "last_result.error"),
    ({"last_result": {"tool": "x" * 100_000, "result": 1}}, "last_result.tool"),
]
#: Nesting the issue found answered 500 (400–800 levels) or with an undocumented 400 (≥ 1,000).
DEPTHS = [33, 400, 800, 1_000, 100_000]


def _refusals(ws_path: Path, **match) -> list[dict]:
    """The ``request_refused`` events of a workspace whose detail has ``match``."""
    ws = Workspace.open(ws_path)
    try:
        events = audit.security_events(ws, "request_refused")
    finally:
        ws.close()
    return [e.detail for e in events if all(e.detail.get(k) == v for k, v in match.items())]


# --------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_copy(tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(run):
    return load_bundle(run.bundle)


@pytest.fixture()
def ws_path(tmp_path):
    return tmp_path / "bounds-ws"


@pytest.fixture()
def engine(bundle, ws_path):
    ws = Workspace.open(ws_path)
    eng = DecisionEngine(ws, bundle, config=ServingConfig(wait_for_intent=True), embedder=HashEmbedder())
    yield eng
    eng.close()
    ws.close()


def _records(engine: DecisionEngine) -> int:
    engine.flush()
    return audit.stats(engine.ws).records


@pytest.mark.parametrize("change, field", LONG_FIELDS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(LONG_FIELDS)])
def test_an_over_long_field_is_refused_in_process_naming_it(engine, ws_path, change, field):
    with pytest.raises(InputError) as exc:
        engine.decide({**_request("long"), **change})
    assert exc.value.field == field, str(exc.value)
    assert len(str(exc.value)) < 400                      # the refusal names, never echoes
    assert _records(engine) == 0 and engine.episode("long") is None
    (event,) = _refusals(ws_path, source="engine")
    assert event["field"] == field and event["reason"] == "invalid_request"
    assert len(json.dumps(event)) < 600                   # no payload in the security log


@pytest.mark.parametrize("levels", DEPTHS)
def test_deep_nesting_is_refused_in_process_before_any_recursion(engine, levels):
    for change, field in [({"messages": [{"role": "tool", "content": _deep(levels)}]}, "messages"),
                          ({"last_result": {"tool": "get_quote", "result": _deep(levels)}}, "last_result.result"),
                          ({"last_result": {"tool": "get_quote", "result": _deep_json(levels)}},
                           "last_result.result")]:
        with pytest.raises(InputError, match="nested deeper than 32 levels") as exc:
            engine.decide({**_request("deep"), **change})
        assert exc.value.field == field
    assert _records(engine) == 0


def test_a_request_at_the_limits_is_served(engine):
    """The limits sit far above what an agent sends: a request just inside all of them is served."""
    message = {"role": "tool", "content": _deep(serving.MAX_NESTING - 1)}       # 32 levels with the message
    request = {**_request("roomy"), "task_type": "analysis", "domain": "d" * serving.MAX_NAME_CHARS,
               "state": {**_request("roomy")["state"], "note": "n" * serving.MAX_STATE_TEXT_CHARS},
               "messages": [message, {"role": "user", "content": "x" * 200_000}],
               "last_result": {"tool": "t" * serving.MAX_TOOL_CHARS, "result": _deep_json(serving.MAX_NESTING),
                               "error": "e" * serving.MAX_ERROR_CHARS}}
    d = engine.decide(request)
    assert d.step_t == 0 and _records(engine) == 1


def test_a_bad_batch_leaves_no_record_and_no_advanced_episode_in_process(engine, ws_path):
    good = [_request(f"b{i}") for i in range(5)]
    bad = {**_request("b-bad"), "messages": [{"role": "tool", "content": _deep(400)}]}
    with pytest.raises(InputError) as exc:
        engine.decide_batch([*good, bad])
    assert (exc.value.field, exc.value.record) == ("messages", 5)
    assert _records(engine) == 0
    assert all(engine.episode(r["episode_id"]) is None for r in good)
    assert [d.step_t for d in engine.decide_batch(good)] == [0] * 5      # the retry starts every episode
    assert _records(engine) == 5
    assert _refusals(ws_path, source="engine", record=5)


def test_an_audit_refusal_serves_none_of_the_batch(engine, monkeypatch):
    """The trail refuses the batch's records: no decision is served, no episode advances
    (before, the records of the requests ahead of the refused one were kept)."""
    accept = AuditWriter._accept

    def refusing(self, rows):
        if any(row[2] == "a3" for row in rows):       # the row's episode_id
            raise AuditUnavailable("the audit trail is full")
        return accept(self, rows)

    monkeypatch.setattr(AuditWriter, "_accept", refusing)
    batch = [_request(f"a{i}") for i in range(5)]
    with pytest.raises(AuditUnavailable):
        engine.decide_batch(batch)
    assert _records(engine) == 0
    assert all(engine.episode(r["episode_id"]) is None for r in batch)
    monkeypatch.setattr(AuditWriter, "_accept", accept)
    assert [d.step_t for d in engine.decide_batch(batch)] == [0] * 5
    assert _records(engine) == 5


def test_rwb_serve_decide_refuses_deep_and_oversized_request_files(run, tmp_path, capsys):
    from core.cli import main

    deep = tmp_path / "deep.json"
    deep.write_text('{"episode_id": "d", "query": "q", "messages": [' + _deep_json(100_000) + "]}")
    huge = tmp_path / "huge.jsonl"
    with open(huge, "wb") as f:                    # sparse: refused by its size, never read
        f.truncate(serving.MAX_REQUESTS_TEXT_BYTES + 1)
    long = tmp_path / "long.json"
    long.write_text(json.dumps({**_request("l"), "domain": "x" * 1_000}))
    for path, says in [(deep, "nested deeper than"), (huge, "a request file may hold"), (long, "domain")]:
        code = main(["--workspace", str(tmp_path / "w"), "serve", "decide", "--policy", str(run.bundle),
                     "--request", f"@{path}"])
        err = capsys.readouterr().err
        assert code == 2 and says in err and "Traceback" not in err, err[-500:]


def test_refusals_are_rate_limited_in_the_security_log(ws_path):
    """A burst is logged whole; past it each refusal is counted, and the count is written with
    the next event the limit admits, or at close."""
    now = [0.0]
    ws = Workspace.open(ws_path)
    log = RefusalLog(ws, None, burst=3, window_s=60.0, clock=lambda: now[0])
    written = [log.refused("http", "unauthorized", endpoint="decide", size=50 * MB) for _ in range(5)]
    assert written == [True, True, True, False, False]
    assert log.refused("http", "too_large", endpoint="decide")          # its own bucket
    now[0] += 20.0                                                      # one event's worth refilled
    assert log.refused("http", "unauthorized", endpoint="decide")
    assert not log.refused("http", "unauthorized", endpoint="decide")
    log.close()
    events = audit.security_events(ws)
    ws.close()
    unauthorized = [e.detail for e in events if e.event == "request_refused" and e.detail["reason"] == "unauthorized"]
    assert len(unauthorized) == 4 and unauthorized[-1]["suppressed"] == 2
    assert [e.detail["suppressed"] for e in events if e.event == "request_refusals_suppressed"] == [1]


# --------------------------------------------------------------------------- over HTTP
class Server:
    def __init__(self, proc: subprocess.Popen, port: int, workspace: Path):
        self.proc, self.port, self.workspace = proc, port, workspace
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0)

    def rss(self) -> int:
        """The server process's resident memory in bytes."""
        try:
            import psutil
        except ImportError:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
        return psutil.Process(self.proc.pid).memory_info().rss

    def peak_growth(self, work) -> int:
        """How far the server's resident memory rose over where it was while ``work()`` ran:
        sampled every 2 ms, and the kernel's own high-water mark (VmHWM, reset first) where
        this process may reset it.  (Memory returned to the system afterwards does not hide
        a body that was read: the peak counts.)"""
        before = self.rss()
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
            exact = True
        except OSError:
            exact = False
        samples, done = [before], threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(self.rss())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            work()
        finally:
            done.set()
            sampler.join()
        peak = max(samples)
        if exact:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            peak = max(peak, int(next(line.split()[1] for line in status.splitlines()
                                      if line.startswith("VmHWM:"))) * 1024)
        return peak - before


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    work = tmp_path_factory.mktemp("bounds-http")
    prod = _trusting_workspace(work / "prod", run)
    port = free_port()
    env = {**os.environ, "RWB_WORKSPACE": str(prod), "RWB_SERVE_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    env.pop("RWB_POLICIES_DIR", None)
    with started([sys.executable, "-c", RWB, "serve", "http", "--policy", str(run.bundle), "--port", str(port),
                  *DETERMINISTIC, "--json"], port=port, env=env, log=work / "server.log") as running:
        srv = Server(running.proc, port, prod)
        yield srv
        srv.client.close()


def _big_body(size: int) -> tuple[bytes, bytes, int]:
    """A valid JSON decide request of ``size`` bytes: its head, tail and the filler between."""
    head, tail = b'{"episode_id":"big","query":"q","messages":[{"role":"user","content":"', b'"}]}'
    return head, tail, size - len(head) - len(tail)


def _post_raw(port: int, path: str, size: int, *, token: str | None, chunked: bool = False) -> tuple[int, dict]:
    """POST a ``size``-byte JSON body as a client that never waits: the body is sent from a
    thread while the answer is read.  Returns the status and the JSON answer."""
    head, tail, filler = _big_body(size)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    length = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}{length}"
                 "\r\n".encode())

    def send_body() -> None:
        block = b"x" * (1 << 20)
        parts = [head] + [block] * (filler // len(block)) + [block[:filler % len(block)], tail]
        try:
            for part in parts:
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: the rest was never wanted

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the server closed without an answer: {data!r}"
        data += more
    header, _, body = data.partition(b"\r\n\r\n")
    length_line = [h for h in header.split(b"\r\n") if h.lower().startswith(b"content-length:")]
    need = int(length_line[0].split(b":")[1]) if length_line else 0
    while len(body) < need:
        more = sock.recv(65536)
        if not more:
            break
        body += more
    sender.join(timeout=120)
    sock.close()
    return int(header.split(b" ")[1]), json.loads(body)


def test_unauthenticated_50mb_bodies_are_refused_without_reading_them(server):
    _post_raw(server.port, "/v1/decide", 50 * MB, token=None)         # warm-up: the first refusal's allocations
    answers = []

    def attack() -> None:
        for path in ["/v1/decide", "/v1/decide/batch"] * 4:
            answers.append(_post_raw(server.port, path, 50 * MB, token=None))

    grown = server.peak_growth(attack)
    assert grown <= 5 * MB, f"the server's memory rose by {grown / MB:.1f} MB over 8 unauthenticated 50 MB bodies"
    assert len(answers) == 8
    assert all(status == 401 and "bearer token is needed" in body["message"] for status, body in answers)
    events = _refusals(server.workspace, source="http", reason="unauthorized")
    assert len(events) >= 9 and all(e["token"] == "missing" and e["status"] == 401 for e in events)
    assert server.client.post("/v1/decide", json=_request("after-401"), headers=AUTH).status_code == 200


def test_a_body_over_the_cap_is_refused_unread_declared_or_chunked(server):
    answers = {}

    def oversized() -> None:
        answers["declared"] = _post_raw(server.port, "/v1/decide", 50 * MB, token=TOKEN)
        answers["chunked"] = _post_raw(server.port, "/v1/decide", 50 * MB, token=TOKEN, chunked=True)
        answers["batch"] = _post_raw(server.port, "/v1/decide/batch", 50 * MB, token=TOKEN)

    grown = server.peak_growth(oversized)
    assert grown <= serve_http.MAX_BODY_BYTES + 5 * MB, f"{grown / MB:.1f} MB"   # at most the cap of one was read
    status, body = answers["declared"]
    assert status == 413 and f"at most {serve_http.MAX_BODY_BYTES:,}" in body["message"]
    assert set(body) == set(serve_http.ErrorOut.model_fields)
    status, body = answers["chunked"]
    assert status == 413 and "more than" in body["message"]
    assert answers["batch"][0] == 413
    r = server.client.post("/v1/decide", json={**_request("five-mb"), "task_type": "x" * (5 * MB)}, headers=AUTH)
    assert r.status_code == 413 and set(r.json()) == set(serve_http.ErrorOut.model_fields)
    events = _refusals(server.workspace, source="http", reason="too_large")
    assert len(events) == 4 and {e["endpoint"] for e in events} == {"decide", "batch"}
    assert server.client.post("/v1/decide", json=_request("after-413"), headers=AUTH).status_code == 200


@pytest.mark.parametrize("change, field", LONG_FIELDS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(LONG_FIELDS)])
def test_an_over_long_field_gets_422_naming_it_over_http(server, change, field):
    r = server.client.post("/v1/decide", json={**_request("http-long"), **change}, headers=AUTH)
    if r.status_code == 413:   # a change past the body cap is refused unread: the field is bounded below it
        pytest.fail(f"{field}: the body cap answered before the field limit")
    assert r.status_code == 422, r.text[:300]
    assert set(r.json()) == set(serve_http.ErrorOut.model_fields) and r.json()["field"] == field
    assert field in r.json()["message"] and len(r.text) < 2000
    assert _refusals(server.workspace, source="http", field=field)


@pytest.mark.parametrize("levels", DEPTHS)
def test_deep_messages_get_422_in_the_documented_shape(server, levels):
    text = json.dumps(_request("http-deep"))[:-1] + ', "messages": [{"role": "tool", "content": ' + \
        _deep_json(levels) + "}]}"
    r = server.client.post("/v1/decide", content=text.encode(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    assert set(r.json()) == set(serve_http.ErrorOut.model_fields)
    assert r.json()["field"] == "messages" and "nested deeper than 32 levels" in r.json()["message"]


def test_a_bad_batch_over_http_leaves_no_record_and_no_advanced_episode(server):
    good = [_request(f"hb{i}") for i in range(5)]
    bad = {**_request("hb-bad"), "messages": [{"role": "tool", "content": _deep(400)}]}
    r = server.client.post("/v1/decide/batch", json={"requests": [*good, bad]}, headers=AUTH)
    assert r.status_code == 422 and (r.json()["field"], r.json()["record"]) == ("messages", 5)
    retry = server.client.post("/v1/decide/batch", json={"requests": good}, headers=AUTH)
    assert retry.status_code == 200, retry.text[:300]
    assert [d["step_t"] for d in retry.json()["decisions"]] == [0] * 5
    served = {d["decision_id"] for d in retry.json()["decisions"]}
    deadline = time.monotonic() + 20
    while True:   # the service commits its records every 0.5 s
        ws = Workspace.open(server.workspace)
        records = [r for r in audit.list_records(ws, limit=10_000) if r.episode_id.startswith("hb")]
        ws.close()
        if served <= {r.decision_id for r in records} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {r.decision_id for r in records} == served     # the refused batch left none
