"""The sentence model in a child process (core.base.embed.ModelProcess) and the engine's use of it.

The protocol tests run a stand-in child (``core.base.embed._serve`` with a tiny encode
function) so they take a fraction of a second; the last tests start the real model."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from core.base.embed import DIM, Embedder, ModelProcess, ModelUnavailable, _model_encode

#: A child that speaks the real protocol with a stand-in model: a text's vector is
#: its length in column 0; "die" kills the child mid-call; "boom" raises.
FAKE = """
import os, sys
import numpy as np
from core.base.embed import DIM, _serve

def encode(texts):
    if "die" in texts:
        os._exit(5)
    if "boom" in texts:
        raise ValueError("no vector for boom")
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    out[:, 0] = [len(t) for t in texts]
    return out

sys.exit(_serve(1, encode, nice=int(sys.argv[1]) if len(sys.argv) > 1 else 0))
"""


def _fake(nice: int = 0, **options) -> ModelProcess:
    return ModelProcess(command=[sys.executable, "-c", FAKE, str(nice)], **options)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie counts as gone once reaped; ModelProcess waits for its child
    return False


def test_texts_go_to_the_child_and_vectors_come_back():
    m = _fake()
    try:
        got = m.encode(["ab", "abcd", ""])
        assert got.shape == (3, DIM) and got.dtype == np.float32
        assert got[:, 0].tolist() == [2.0, 4.0, 0.0] and not got[:, 1:].any()
        assert m.encode([]).shape == (0, DIM)
        assert m.starts == 1 and m.pid is not None
    finally:
        m.close()


def test_the_child_runs_at_a_lower_priority_than_its_caller():
    m = _fake(nice=7)
    try:
        m.start()
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, m.pid) == min(own + 7, 19)
    finally:
        m.close()


def test_an_error_in_the_child_is_raised_and_the_child_keeps_serving():
    m = _fake()
    try:
        with pytest.raises(ModelUnavailable, match="failed to embed: ValueError: no vector for boom"):
            m.encode(["boom"])
        pid = m.pid
        assert m.encode(["abc"])[0, 0] == 3.0 and m.pid == pid and m.starts == 1
    finally:
        m.close()


def test_a_child_that_dies_mid_call_is_reported_and_the_next_call_starts_a_new_one():
    m = _fake()
    try:
        m.start()
        first = m.pid
        with pytest.raises(ModelUnavailable, match=r"exited \(code 5\)"):
            m.encode(["die"])
        assert m.pid is None
        assert m.encode(["abcde"])[0, 0] == 5.0
        assert m.starts == 2 and m.pid not in (None, first)
    finally:
        m.close()


@pytest.mark.timeout(120)  # a wait for the silent child (it never exits) fails the test here
def test_a_child_that_cannot_start_or_does_not_answer_is_reported_and_stopped(monkeypatch):
    import subprocess

    crash = ModelProcess(command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(ModelUnavailable, match=r"exited \(code 3\) before it could start"):
        crash.start()
    assert crash.pid is None
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recorded_popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recorded_popen)
    silent = ModelProcess(command=[sys.executable, "-c", "import time; time.sleep(10 ** 6)"], start_timeout_s=0.5)
    with pytest.raises(ModelUnavailable, match="did not start within 0.5 s; it was stopped"):
        silent.encode(["x"])
    assert silent.pid is None
    [child] = started
    assert child.poll() is not None and child.returncode < 0  # ended by a signal: stopped, not waited for


def test_close_stops_the_child():
    m = _fake()
    m.start()
    pid = m.pid
    m.close()
    assert m.pid is None and _gone(pid)
    m.close()  # twice is fine


# --------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def model():
    m = ModelProcess()
    yield m
    m.close()


def test_the_child_embeds_exactly_like_the_model_in_this_process(model):
    texts = ["buy 100 shares of Moutai", "what is the risk of my portfolio?"]
    assert np.allclose(model.encode(texts), _model_encode(texts), atol=1e-6)


def test_a_process_reader_reads_the_cache_and_sends_only_the_rest_to_the_child(tmp_path, model):
    emb = Embedder(cache_dir=tmp_path / "cache")
    stored = emb.encode(["buy Moutai"])
    index = (tmp_path / "cache" / "index.json").read_bytes()
    reader = emb.reader()
    reader.model = model  # the module's child (reader(process=True) would start its own)
    got = reader.encode(["buy Moutai", "sell Moutai"])
    assert np.array_equal(got[0], stored[0])
    assert np.allclose(got[1], _model_encode(["sell Moutai"])[0], atol=1e-6)
    assert reader.stats == {"hits": 1, "encoded": 1}
    assert (tmp_path / "cache" / "index.json").read_bytes() == index


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    """The shared test bundle (trained with the hash embedder, as everywhere in the suite),
    its baseline at confidence 0.5 so that every request runs RL-Boost."""
    from _bundle_fixtures import hash_embedder
    from core.govern.bundle import load_bundle
    from test_serving import _tokens, _with_rde

    with pytest.MonkeyPatch.context() as mp:
        hash_embedder(mp)
        loaded = load_bundle(tiny_bundle)
    l1, l2 = _tokens(loaded)[0][:2]
    return _with_rde(loaded, {l1: 0.5, l2: 0.5})


def test_the_engine_runs_its_sentence_model_in_a_child_it_stops_on_close(tmp_path, bundle):
    """Default engine: the child starts with the engine, a new query's RL-Boost is deferred
    while the child embeds it, the episode's next request is boosted, and close() stops the
    child.  model_process=False keeps the model in this process."""
    from core.serve.serving import DecisionEngine, ServingConfig
    from core.records.store import Workspace
    from test_serving import _request

    ws = Workspace.open(tmp_path / "ws")
    engine = DecisionEngine(ws, bundle)
    try:
        assert engine.ready(timeout=120)
        child = engine.embedder.model.pid
        assert child is not None and child != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, child) == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
        first = engine.decide(_request(episode="ep-child"))
        assert first.rl_boost and first.intent_pending and not first.rl_candidates
        assert engine.ready(timeout=60)
        second = engine.decide(_request(episode="ep-child"))
        assert second.rl_boost and not second.intent_pending and second.rl_candidates
        assert engine.embedder.stats == {"hits": 0, "encoded": 1}
    finally:
        engine.close()
    assert engine.embedder.model.pid is None and _gone(child)
    in_process = DecisionEngine(ws, bundle, config=ServingConfig(model_process=False))
    try:
        assert in_process.embedder.model is None
    finally:
        in_process.close()
    ws.close()
