"""The shared embedding store (core.base.embed_store): a text embedded for one workspace is
not embedded again for another, packs from other processes are found, another model's
vectors are never served, and a broken or unwritable store never breaks embedding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.base.embed import DIM, Embedder, _model_encode
from core.base.embed_store import ENV_VAR, SharedEmbeddings, packaged_model_digest, shared_store

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["refund order 1042 to the original card", "the portfolio's risk is moderate", "buy 100 shares"]


def _hashes(texts):
    from core.base.embed import text_hash

    return [text_hash(t) for t in texts]


def test_a_second_workspace_takes_the_first_ones_embeddings_from_the_store(tmp_path):
    store = SharedEmbeddings(tmp_path / "store", packaged_model_digest(), DIM)
    first = Embedder(cache_dir=tmp_path / "ws1", shared=store)
    a = first.encode(TEXTS)
    assert first.stats == {"hits": 0, "encoded": 3}
    second = Embedder(cache_dir=tmp_path / "ws2", shared=SharedEmbeddings(tmp_path / "store", packaged_model_digest(), DIM))
    b = second.encode(TEXTS[::-1])
    assert second.stats == {"hits": 3, "encoded": 0}
    assert np.array_equal(b[::-1], a)
    assert np.allclose(a, _model_encode(TEXTS), atol=1e-6)      # what the model computes
    # the second workspace keeps its own copy: it reads them back with the store gone
    third = Embedder(cache_dir=tmp_path / "ws2", shared=None)
    assert np.array_equal(third.encode(TEXTS), a) and third.stats == {"hits": 3, "encoded": 0}


def test_only_the_missing_texts_go_to_the_model(tmp_path):
    store = SharedEmbeddings(tmp_path / "store", packaged_model_digest(), DIM)
    Embedder(shared=store).encode(TEXTS[:2])
    emb = Embedder(shared=store)
    out = emb.encode(TEXTS)
    assert emb.stats == {"hits": 2, "encoded": 1}
    assert np.allclose(out, _model_encode(TEXTS), atol=1e-6)


def test_a_pack_another_process_writes_is_found_on_the_next_miss(tmp_path):
    digest = "ab" * 32
    reader = SharedEmbeddings(tmp_path, digest, 4)
    assert reader.lookup(_hashes(["x"])) == {}
    code = ("import numpy as np, sys; from core.base.embed_store import SharedEmbeddings; "
            "from core.base.embed import text_hash; "
            f"SharedEmbeddings(sys.argv[1], {digest!r}, 4).add([text_hash('x'), text_hash('y')], "
            "np.arange(8, dtype=np.float32).reshape(2, 4))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=ROOT, timeout=120)
    found = reader.lookup(_hashes(["x", "y", "z"]))
    assert sorted(found) == sorted(_hashes(["x", "y"]))
    assert found[_hashes(["y"])[0]].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_another_models_vectors_are_never_served(tmp_path):
    SharedEmbeddings(tmp_path, "11" * 32, 4).add(_hashes(["x"]), np.ones((1, 4), np.float32))
    assert SharedEmbeddings(tmp_path, "22" * 32, 4).lookup(_hashes(["x"])) == {}
    assert list(SharedEmbeddings(tmp_path, "11" * 32, 4).lookup(_hashes(["x"]))) == _hashes(["x"])


def test_a_pack_whose_rows_do_not_match_its_keys_is_skipped(tmp_path):
    digest = "33" * 32
    folder = tmp_path / digest[:32]
    folder.mkdir()
    np.save(folder / "broken.npy", np.ones((3, 4), np.float32))        # three rows …
    (folder / "broken.keys").write_bytes(bytes.fromhex(_hashes(["x"])[0]))   # … one key
    np.save(folder / "wide.npy", np.ones((1, 5), np.float32))         # another width
    (folder / "wide.keys").write_bytes(bytes.fromhex(_hashes(["x"])[0]))
    (folder / "gone.keys").write_bytes(bytes.fromhex(_hashes(["x"])[0]))   # rows missing
    assert SharedEmbeddings(tmp_path, digest, 4).lookup(_hashes(["x"])) == {}


def test_an_unwritable_store_only_costs_the_saving(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = SharedEmbeddings(blocker, packaged_model_digest(), DIM)   # its folder cannot be made
    emb = Embedder(shared=store)
    assert np.allclose(emb.encode(TEXTS[:1]), _model_encode(TEXTS[:1]), atol=1e-6)
    assert emb.stats == {"hits": 0, "encoded": 1}


def test_the_store_is_opt_in_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert shared_store(DIM) is None
    assert Embedder().shared() is None
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "machine"))
    store = shared_store(DIM)
    assert store is not None and store.folder.parent == (tmp_path / "machine").resolve()
    assert shared_store(DIM) is store                      # one per process and folder
    assert Embedder().shared() is store
    assert Embedder(shared=None).shared() is None


@pytest.mark.parametrize("bad", ["", "   "])
def test_an_empty_setting_means_no_store(bad, monkeypatch):
    monkeypatch.setenv(ENV_VAR, bad)
    assert shared_store(DIM) is None


def test_a_new_workspace_scores_its_samples_from_their_shipped_stores(tmp_path, monkeypatch):
    """The stores the samples ship hold every text scoring the samples with every template
    embeds (a new workspace runs the model on none), and the model's own vectors for them
    (``rwb datasets sample-embeddings`` rebuilds them when this fails)."""
    from core.records.store import Workspace
    from core.sample.warmup import prepare_workspace

    monkeypatch.delenv(ENV_VAR, raising=False)        # the shipped stores alone
    seen: list[str] = []
    encode = Embedder.encode
    monkeypatch.setattr(Embedder, "encode", lambda self, texts, **kw: (seen.extend(texts), encode(self, texts, **kw))[1])
    ws = Workspace.open(tmp_path / "ws")
    try:
        report = prepare_workspace(ws)
        cache = Embedder(ws.artifact_dir("embeddings"), shared=None)
    finally:
        ws.close()
    assert len(report.scorings) >= 4 and all(s.error is None for s in report.scorings)
    assert [s.embedded for s in report.scorings] == [0] * len(report.scorings)
    distinct = sorted(set(seen))
    assert len(cache.cached()[0]) >= len(distinct) > 1000
    probe = distinct[:: max(1, len(distinct) // 12)][:12]
    assert np.allclose(cache.encode(probe), _model_encode(probe), atol=1e-5)


def test_a_truncated_pack_is_skipped_and_a_row_count_mismatch_refused(tmp_path):
    digest = "44" * 32
    folder = tmp_path / digest[:32]
    folder.mkdir()
    (folder / "cut.npy").write_bytes(b"")                                 # cut short: no header at all
    (folder / "cut.keys").write_bytes(bytes.fromhex(_hashes(["x"])[0]))
    store = SharedEmbeddings(tmp_path, digest, 4)
    assert store.lookup(_hashes(["x"])) == {}
    with pytest.raises(ValueError, match="2 hashes for 1 rows"):
        store.add(_hashes(["x", "y"]), np.ones((1, 4), np.float32))
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert SharedEmbeddings(blocked, digest, 4).add(_hashes(["x"]), np.ones((1, 4), np.float32)) is False
    assert store.add(_hashes(["x"]), np.ones((1, 4), np.float32)) is True
