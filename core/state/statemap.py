"""The state map: t-SNE of encoded states, encoding fidelity and action entropy.

Answers three questions of docs/design.md §8's four-step diagnosis: does the encoder see the
task (:func:`state_fidelity`), what does the state space look like (:func:`tsne_map`,
:meth:`TsneMap.transform`), and does the agent explore (:func:`action_entropy`,
:func:`policy_entropy`).  :func:`states_map` and :func:`states_entropy` are the functions behind
``rwb states map`` / ``rwb states entropy`` and the State Explorer page; they return data
(:class:`StateMapReport`), and the app draws the figures.

Details: docs/state.md (## Encoding fidelity, ## The t-SNE map, ## Action entropy, ## Commands
and the page).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.base.errors import InputError
from core.state.features import (
    RawStateFeatures,
    StateEncoderConfig,
    cached_features,
    encode_states,
    raw_features_for_dataset,
    require_dataset,
    write_atomic,
)
from core.data.importers import read_file
from core.records.catalog import build_catalog, catalog_for_dataset

#: Bump when the cached map layout (or the fidelity verdict's wording) changes.
MAP_VERSION = 3


# --------------------------------------------------------------------------- t-SNE
@dataclass
class TsneConfig:
    """Settings of the state map's t-SNE (defaults tuned in benchmarks/bench_tsne.py)."""

    #: Dimensions kept by the PCA that runs first (noise removal and speed).
    pca_dims: int = 50
    #: Effective number of neighbours each point attends to.  40 rather than the usual 30:
    #: on 20k encoded states it keeps neighbourhoods slightly better (trustworthiness
    #: 0.9826 vs 0.9818, mean of three subsamples) at about the same cost.
    perplexity: float = 40.0
    #: Iterations of the early-exaggeration phase (cluster formation) and of the normal
    #: phase.  Starting from the PCA layout with the learning rate N/12, a short schedule
    #: reaches the trustworthiness of openTSNE's default 250 + 500 (bench_tsne.py).
    early_exaggeration_iter: int = 100
    n_iter: int = 150
    #: Nearest neighbours: "exact" (brute force on BLAS), "annoy" (approximate, bundled
    #: with openTSNE) or "auto": exact up to EXACT_NEIGHBOURS_MAX points, where one matrix
    #: product beats building trees, annoy above.
    neighbors: str = "auto"
    #: Repulsive forces: "fft" (interpolation, linear in N), "bh" (Barnes-Hut) or "auto":
    #: BH below FFT_MIN points, where FFT's fixed grid cost dominates, FFT above, where its
    #: linear cost wins.
    negative_gradient_method: str = "auto"
    #: Threads for neighbours and gradients; 0 = one thread below SMALL_MAP points (where
    #: thread synchronisation per iteration costs more than it saves, badly so on a busy
    #: machine), else two.
    n_jobs: int = 0
    seed: int = 0


#: Maps with fewer points run single-threaded when ``TsneConfig.n_jobs`` is 0.
SMALL_MAP = 5000
#: From this many points ``negative_gradient_method="auto"`` uses FFT.
FFT_MIN = 2000
#: Up to this many points ``neighbors="auto"`` searches neighbours exactly.
EXACT_NEIGHBOURS_MAX = 30_000


def _threads(config: TsneConfig, n: int) -> int:
    return config.n_jobs if config.n_jobs > 0 else (1 if n < SMALL_MAP else 2)


def _gradient_method(config: TsneConfig, n: int) -> str:
    if config.negative_gradient_method == "auto":
        return "fft" if n >= FFT_MIN else "bh"
    return config.negative_gradient_method


def _neighbours(config: TsneConfig, n: int) -> dict[str, Any]:
    """openTSNE's neighbour-search arguments for ``n`` points."""
    method = config.neighbors
    if method == "auto":
        method = "exact" if n <= EXACT_NEIGHBOURS_MAX else "annoy"
    if method == "exact":
        # sklearn's brute force: chunked distance matrix products (a k-d tree is slow in 50-d)
        return {"method": "exact", "knn_kwargs": {"algorithm": "brute"}}
    return {"method": method}


@dataclass
class TsneMap:
    """A fitted 2-D map: coordinates plus what is needed to place new states on it."""

    coords: np.ndarray          # [N, 2]
    pca_mean: np.ndarray        # [D]
    pca_components: np.ndarray  # [k, D]
    config: TsneConfig
    seconds: float
    _embedding: Any = None      # openTSNE.TSNEEmbedding (rebuilt lazily after a reload)
    _reduced: np.ndarray | None = None

    def reduce(self, X: np.ndarray) -> np.ndarray:
        """The PCA projection the map was fitted on."""
        return ((np.asarray(X, dtype=np.float64) - self.pca_mean) @ self.pca_components.T).astype(np.float64)

    def transform(self, X_new: np.ndarray) -> np.ndarray:
        """[M, 2] positions of new states on this map, without moving the existing points
        (openTSNE's ``transform``: much cheaper than recomputing the map)."""
        if self._embedding is None:
            # a loaded map: rebuild the neighbour graph of its states (no optimisation)
            import openTSNE

            n_jobs = _threads(self.config, len(self.coords))
            aff = openTSNE.affinity.PerplexityBasedNN(
                self._reduced, perplexity=self.config.perplexity, n_jobs=n_jobs,
                random_state=self.config.seed, **_neighbours(self.config, len(self.coords)))
            self._embedding = openTSNE.TSNEEmbedding(
                self.coords, aff, negative_gradient_method=_gradient_method(self.config, len(self.coords)),
                n_jobs=n_jobs, random_state=self.config.seed)
        return np.asarray(self._embedding.transform(self.reduce(X_new)), dtype=np.float64)

    def save(self, path: str | Path) -> None:
        """Write ``<path>.safetensors`` (coordinates, PCA, reduced states) and ``<path>.json``
        (the settings): enough for a later process to :meth:`transform` onto this map."""
        from safetensors.numpy import save_file

        if self._reduced is None:
            raise InputError("this map has no reduced states to save")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"coords": np.ascontiguousarray(self.coords), "pca_mean": self.pca_mean,
                  "pca_components": np.ascontiguousarray(self.pca_components),
                  "reduced": np.ascontiguousarray(self._reduced)}
        write_atomic(path.with_name(path.name + ".safetensors"), lambda tmp: save_file(arrays, str(tmp)))
        meta = json.dumps({"config": asdict(self.config), "seconds": self.seconds})
        write_atomic(path.with_name(path.name + ".json"), lambda tmp: tmp.write_text(meta))

    @classmethod
    def load(cls, path: str | Path) -> "TsneMap":
        """Read what :meth:`save` wrote; the neighbour graph is rebuilt on the first transform."""
        from safetensors.numpy import load_file

        path = Path(path)
        meta = json.loads(path.with_name(path.name + ".json").read_text())
        a = load_file(str(path.with_name(path.name + ".safetensors")))
        return cls(coords=a["coords"], pca_mean=a["pca_mean"], pca_components=a["pca_components"],
                   config=TsneConfig(**meta["config"]), seconds=float(meta["seconds"]), _reduced=a["reduced"])


def pca_reduce(X: np.ndarray, dims: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(reduced [N, k], mean [D], components [k, D]) with k = min(dims, N, D).

    Exact PCA from the D×D covariance (one matrix product and a small eigendecomposition,
    faster than a randomized SVD for the encoder's D = 512); each component's sign is
    fixed so that its largest loading is positive, which makes the result deterministic.
    Wide inputs (D > 2048) go through sklearn's randomized PCA instead."""
    X = np.asarray(X, dtype=np.float64)
    n, d = X.shape
    k = int(min(dims, n, d))
    if d > 2048:
        from sklearn.decomposition import PCA

        pca = PCA(n_components=k, svd_solver="randomized", random_state=seed)
        return pca.fit_transform(X), pca.mean_, pca.components_
    mean = X.mean(axis=0)
    Xc = X - mean
    cov = Xc.T @ Xc
    # The eigendecomposition is many small BLAS calls: on a busy machine a second BLAS
    # thread that is not scheduled stalls every one of them, and one thread handles a
    # 512×512 matrix quickly anyway.
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, user_api="blas"):
        _, vectors = np.linalg.eigh(cov)
    comps = vectors[:, ::-1][:, :k].T                                  # [k, D], largest first
    comps *= np.sign(comps[np.arange(k), np.abs(comps).argmax(axis=1)])[:, None]
    return Xc @ comps.T, mean, comps


def _check_map_input(X: np.ndarray, perplexity: float) -> np.ndarray:
    X = np.asarray(X)
    if X.ndim != 2:
        raise InputError(f"states must be a 2-D matrix, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise InputError("states contain NaN or infinity")
    if X.shape[0] < 3 * perplexity + 2:
        raise InputError(f"a t-SNE map with perplexity {perplexity:g} needs at least "
                         f"{int(3 * perplexity + 2)} states, got {X.shape[0]}")
    return X


def tsne_map(X: np.ndarray, config: TsneConfig | None = None) -> TsneMap:
    """2-D map of the states ``X`` [N, D]: PCA first, then openTSNE. Deterministic per seed."""
    import openTSNE

    c = config or TsneConfig()
    X = _check_map_input(X, c.perplexity)
    start = time.perf_counter()
    reduced, mean, comps = pca_reduce(X, c.pca_dims, c.seed)
    tsne = openTSNE.TSNE(
        n_components=2, perplexity=c.perplexity, early_exaggeration_iter=c.early_exaggeration_iter,
        n_iter=c.n_iter, initialization="pca", neighbors=_neighbours(c, X.shape[0])["method"],
        knn_kwargs=_neighbours(c, X.shape[0]).get("knn_kwargs"),
        negative_gradient_method=_gradient_method(c, X.shape[0]),
        n_jobs=_threads(c, X.shape[0]), random_state=c.seed, verbose=False)
    embedding = tsne.fit(reduced)
    return TsneMap(coords=np.asarray(embedding, dtype=np.float64), pca_mean=mean, pca_components=comps,
                   config=c, seconds=time.perf_counter() - start, _embedding=embedding, _reduced=reduced)


def tsne_map_sklearn(X: np.ndarray, config: TsneConfig | None = None, *, max_iter: int | None = None) -> np.ndarray:
    """Reference map with ``sklearn.manifold.TSNE`` (Barnes-Hut) after the same PCA."""
    from sklearn.manifold import TSNE

    c = config or TsneConfig()
    X = _check_map_input(X, c.perplexity)
    reduced, _, _ = pca_reduce(X, c.pca_dims, c.seed)
    kwargs: dict[str, Any] = {} if max_iter is None else {"max_iter": max_iter}
    return TSNE(n_components=2, perplexity=c.perplexity, init="pca", learning_rate="auto",
                random_state=c.seed, n_jobs=_threads(c, X.shape[0]), **kwargs).fit_transform(reduced)


# --------------------------------------------------------------------------- fidelity
@dataclass
class Fidelity:
    """How well the encoded states separate by a label (task type)."""

    label: str
    n_points: int
    n_labels: int
    #: Silhouette in the original space by the true labels, and the mean and standard
    #: deviation over a few random shufflings of the same labels (the no-structure baseline).
    silhouette: float | None
    silhouette_shuffled: float | None
    #: Share of each state's k nearest neighbours from other episodes with its label,
    #: and the share expected by chance (Σ p_c²).
    knn_agreement: float | None
    knn_chance: float | None
    k: int
    silhouette_shuffled_std: float | None = None
    #: Silhouette with the intent encoder off (same states, same sample), when computed.
    silhouette_intent_off: float | None = None
    #: Silhouette margin over shuffled labels of each part of the state on its own
    #: (request, tool context, trace: the inputs of the encoder's branches), when computed.
    part_margins: dict[str, float] | None = None
    verdict: str = ""
    #: The verdict in plain words, without figures (what a page shows first).
    summary: str = ""
    separates: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Verdict thresholds.  An encoded state also carries the tool context and the trace,
# which change from step to step inside one task, so a task type forms several tight
# sub-clusters (one per stage of the task) rather than one ball: the silhouette by task
# type stays small even when neighbourhoods are pure (kNN agreement high).  What tells a
# working encoder from a broken one is the margin over shuffled labels (whose own spread
# is ~0.001) and over chance.  On generated finance data a healthy encoder shows a
# silhouette margin ~0.05 and kNN margin ~0.6; with queries truncated to 12 characters
# ~0.01 and ~0.4; with the intent encoder off ~0.01 and ~0.4.
GOOD_SILHOUETTE_MARGIN, GOOD_KNN_MARGIN = 0.03, 0.30
POOR_SILHOUETTE_MARGIN, POOR_KNN_MARGIN = 0.01, 0.10
#: The intent encoder must add at least this much silhouette over the same states without it.
MIN_INTENT_GAIN = 0.01
#: Shufflings averaged for the baseline silhouette.
N_SHUFFLES = 3
#: States used to judge each part of the state on its own (silhouette is quadratic in it).
PART_SAMPLE = 2000
#: Names of the parts of a state, as the verdict says them.
PART_NAMES = {"request": "the request", "tool_context": "the tool context", "trace": "the trace"}


def _sample(n: int, size: int, seed: int) -> np.ndarray:
    if n <= size:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def knn_label_agreement(X: np.ndarray, labels: np.ndarray, groups: np.ndarray | None = None, *,
                        k: int = 10) -> float:
    """Mean share of each point's ``k`` nearest neighbours (Euclidean) that carry its label.

    Neighbours in the same ``group`` (the same episode) are skipped: steps of one
    episode share a request, so counting them would flatter the encoder."""
    from sklearn.neighbors import NearestNeighbors

    X = np.asarray(X, dtype=np.float32)
    labels = np.asarray(labels)
    n = X.shape[0]
    groups = np.arange(n) if groups is None else np.asarray(groups)
    _, counts = np.unique(groups, return_counts=True)
    want = min(n, k + int(counts.max()))
    idx = NearestNeighbors(n_neighbors=want).fit(X).kneighbors(X, return_distance=False)
    other = groups[idx] != groups[:, None]             # drops the point itself too
    take = other & (np.cumsum(other, axis=1) <= k)     # the first k from other episodes
    same = (labels[idx] == labels[:, None]) & take
    n_taken = take.sum(axis=1)
    ok = n_taken > 0
    if not ok.any():
        return float("nan")
    return float((same.sum(axis=1)[ok] / n_taken[ok]).mean())


def silhouette_by_label(X: np.ndarray, labels: np.ndarray) -> float:
    """Silhouette score (Euclidean, original space) of ``X`` grouped by ``labels``."""
    from sklearn.metrics import silhouette_score

    return float(silhouette_score(np.asarray(X, dtype=np.float32), np.asarray(labels), metric="euclidean"))


def state_parts(raw: RawStateFeatures, index: np.ndarray, *, intent: bool = True) -> dict[str, np.ndarray]:
    """The parts of the states of steps ``index`` as the encoder reads them: the request
    (sentence embedding and intent rules), the tool context (latest result and scalar
    state) and the trace (one-hot tokens of the previous steps).  ``intent=False`` leaves
    the request out, as the intent encoder's ablation does."""
    idx = np.asarray(index, dtype=np.int64)
    ep = raw.step_episode[idx]
    onehot = np.zeros((len(idx), raw.trace_action.shape[1], raw.n_actions + 2), dtype=np.float32)
    np.put_along_axis(onehot, (raw.trace_action[idx] + 2)[..., None], 1.0, axis=2)
    parts = {"request": np.concatenate([raw.intent_emb[ep], raw.intent_rules[ep]], axis=1)} if intent else {}
    parts["tool_context"] = np.asarray(raw.context[idx], dtype=np.float32)
    parts["trace"] = onehot.reshape(len(idx), -1)
    return parts


def _part_margins(parts: dict[str, np.ndarray], labels: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """Silhouette margin over shuffled labels of each part (rows: the same states)."""
    margins = {}
    for name, P in parts.items():
        P = np.asarray(P, dtype=np.float32)
        if np.ptp(P, axis=0).max(initial=0.0) == 0.0:   # a constant part separates nothing
            margins[name] = 0.0
            continue
        shuffled = np.mean([silhouette_by_label(P, rng.permutation(labels)) for _ in range(N_SHUFFLES)])
        margins[name] = silhouette_by_label(P, labels) - float(shuffled)
    return margins


def _advice(what: str, margins: dict[str, float] | None, intent_weak: bool) -> str:
    """What to look at when the states separate only partly or poorly: the part of the
    state that carries no structure of its own, by its silhouette margin."""
    check_intent = "check the intent encoder, e.g. truncated or empty queries"
    if intent_weak:
        return f"the request adds little to the state: {check_intent}"
    if not margins:
        return (f"check the intent encoder (e.g. truncated or empty queries) and whether the tool calls "
                f"and their results differ across {what}")
    weak = [name for name, m in margins.items() if m < POOR_SILHOUETTE_MARGIN]
    figures = ", ".join(f"{PART_NAMES.get(n, n)} {m:.3f}" for n, m in margins.items())
    if not weak:
        return (f"each part of the state separates them a little on its own (silhouette margin over "
                f"shuffled: {figures}), but no part clearly")
    said = " and ".join(PART_NAMES.get(n, n) for n in weak)
    verb = "carries" if len(weak) == 1 else "carry"
    advice = (f"{said} {verb} little {what[:-1]} structure of its own (silhouette margin over shuffled: "
              f"{figures})")
    if "request" in weak:
        return f"{advice}: {check_intent}"
    return f"{advice}: the tool calls and their results look alike across {what}"


def _plain_advice(what: str, margins: dict[str, float] | None, intent_weak: bool) -> str:
    """:func:`_advice` without figures: what to look at, in the analyst's words."""
    check_requests = "check that the users' requests are recorded in full (not cut short or empty)"
    if intent_weak:
        return f"the user's request adds little to the state: {check_requests}"
    weak = [name for name, m in (margins or {}).items() if m < POOR_SILHOUETTE_MARGIN]
    if not weak:
        return f"{check_requests}, and whether the tool calls and their results differ across {what}"
    said = " and ".join(PART_NAMES.get(n, n) for n in weak)
    if "request" in weak:
        return f"{said} tell little apart on {'its' if len(weak) == 1 else 'their'} own: {check_requests}"
    return f"{said} tell little apart: the tool calls and their results look alike across {what}"


def state_fidelity(X: np.ndarray, labels: Sequence[Any], groups: np.ndarray | None = None, *,
                   label: str = "task_type", X_intent_off: np.ndarray | None = None,
                   parts: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None,
                   sample: int = 4000, k: int = 10, seed: int = 0) -> Fidelity:
    """Silhouette (true vs shuffled labels), kNN agreement and a verdict for states ``X``.

    States with no label (None or "") are left out.  Both silhouettes and the kNN
    agreement use the same random sample of at most ``sample`` states.  ``parts`` gives,
    for row positions of ``X``, those states split into request, tool context and trace
    (:func:`state_parts`): a verdict short of "well" then names the part without
    structure of its own, judged on at most ``PART_SAMPLE`` of the sampled states."""
    lab = np.array(["" if v is None else str(v) for v in labels], dtype=object)
    keep = np.flatnonzero(lab != "")
    idx = keep[_sample(len(keep), sample, seed)]
    lab_s = lab[idx]
    classes, counts = np.unique(lab_s, return_counts=True) if len(idx) else (np.array([]), np.array([]))
    fid = Fidelity(label=label, n_points=int(len(idx)), n_labels=int(len(classes)), silhouette=None,
                   silhouette_shuffled=None, knn_agreement=None, knn_chance=None, k=k)
    if len(classes) < 2 or len(idx) <= len(classes):
        fid.verdict = (f"cannot judge the encoding: the states carry {len(classes)} distinct "
                       f"{label} value(s); at least 2 are needed")
        fid.summary = (f"Cannot judge whether the map tells {label.replace('_', ' ')}s apart: the steps "
                       f"carry {len(classes)} of them, at least 2 are needed.")
        return fid
    Xs = np.asarray(X)[idx]
    rng = np.random.default_rng(seed)
    fid.silhouette = silhouette_by_label(Xs, lab_s)
    shuffled = [silhouette_by_label(Xs, rng.permutation(lab_s)) for _ in range(N_SHUFFLES)]
    fid.silhouette_shuffled = float(np.mean(shuffled))
    fid.silhouette_shuffled_std = float(np.std(shuffled))
    g = None if groups is None else np.asarray(groups)[idx]
    fid.knn_agreement = knn_label_agreement(Xs, lab_s, g, k=k)
    p = counts / counts.sum()
    fid.knn_chance = float((p ** 2).sum())
    if X_intent_off is not None:
        fid.silhouette_intent_off = silhouette_by_label(np.asarray(X_intent_off)[idx], lab_s)
    sil_margin = fid.silhouette - fid.silhouette_shuffled
    knn_margin = fid.knn_agreement - fid.knn_chance
    what = label.replace("_", " ") + "s"
    numbers = (f"silhouette {fid.silhouette:.3f} vs {fid.silhouette_shuffled:.3f} shuffled, "
               f"kNN agreement {fid.knn_agreement:.2f} vs {fid.knn_chance:.2f} by chance")
    intent_weak = (fid.silhouette_intent_off is not None
                   and fid.silhouette - fid.silhouette_intent_off < MIN_INTENT_GAIN)
    if intent_weak:
        numbers += f"; {fid.silhouette_intent_off:.3f} with the intent encoder off"
    if sil_margin >= GOOD_SILHOUETTE_MARGIN and knn_margin >= GOOD_KNN_MARGIN and not intent_weak:
        fid.separates = True
        fid.verdict = f"{what} separate well ({numbers})"
        fid.summary = (f"The map tells {what} apart well: steps of the same {what[:-1]} lie together far "
                       "more often than by chance.")
        return fid
    if parts:
        sub = _sample(len(idx), PART_SAMPLE, seed)
        if len(np.unique(lab_s[sub])) >= 2:
            fid.part_margins = _part_margins(parts(idx[sub]), lab_s[sub], rng)
    advice = _advice(what, fid.part_margins, intent_weak)
    if sil_margin < POOR_SILHOUETTE_MARGIN or knn_margin < POOR_KNN_MARGIN:
        fid.separates = False
        fid.verdict = f"{what} separate poorly ({numbers}) — {advice}"
        fid.summary = (f"The map hardly tells {what} apart: "
                       f"{_plain_advice(what, fid.part_margins, intent_weak)}.")
    else:
        fid.separates = None
        fid.verdict = f"{what} separate only partly ({numbers}) — {advice}"
        fid.summary = (f"The map tells {what} apart only partly: "
                       f"{_plain_advice(what, fid.part_margins, intent_weak)}.")
    return fid


# --------------------------------------------------------------------------- entropy
def shannon_entropy(weights: np.ndarray, axis: int = -1) -> np.ndarray:
    """Entropy in nats of counts or probabilities along ``axis`` (normalised first; 0·log 0 = 0).

    >>> float(shannon_entropy(np.ones(4)))  # uniform over 4 → log 4
    1.3862943611198906
    """
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum(axis=axis, keepdims=True)
    p = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    logp = np.log(p, out=np.zeros_like(p), where=p > 0)
    return np.maximum(-(p * logp).sum(axis=axis), 0.0)   # a certain action gives 0, not -0


@dataclass
class GroupEntropy:
    """Entropy of the actions within one group (a tool or a state cluster)."""

    group: str
    n: float
    entropy: float
    #: Entropy of a uniform choice among the actions the group could use (log of their count).
    max_entropy: float
    top_action: str | None = None
    #: Policies only: mean entropy of the per-state distributions in the group.
    mean_state_entropy: float | None = None


@dataclass
class EntropyReport:
    """Action-distribution entropy (nats): overall, per tool, per state cluster."""

    source: str                 # "logged" or "policy"
    n: float
    overall: float
    max_overall: float
    per_tool: list[GroupEntropy]
    per_cluster: list[GroupEntropy]
    #: H(action | cluster): the cluster-size-weighted mean of the per-cluster entropies.
    conditional: float | None
    n_invalid: int = 0
    mean_state_entropy: float | None = None
    verdict: str = ""
    #: The verdict in plain words, without figures.
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Below this entropy (nats) exploration is too narrow (docs/design.md §8, step 4).
LOW_ENTROPY = 1.0


def _token_tools(tokens: Sequence[Any]) -> list[str]:
    """The group each catalog token belongs to: its tool, or its kind for special tokens."""
    return [t.tool if getattr(t, "tool", None) else f"({t.kind})" for t in tokens]


def _groups_entropy(dist: np.ndarray, names: list[str], token_names: list[str],
                    group_of_token: np.ndarray, n_groups: int, labels: list[str],
                    state_entropy_sum: np.ndarray | None = None) -> list[GroupEntropy]:
    """Per-group entropies of a [G, A] action-count (or probability-mass) matrix."""
    h = shannon_entropy(dist, axis=1)
    size = dist.sum(axis=1)
    out = []
    for g in range(n_groups):
        if size[g] <= 0:
            continue
        allowed = int((group_of_token == g).sum()) if group_of_token.size else dist.shape[1]
        out.append(GroupEntropy(
            group=labels[g], n=float(size[g]), entropy=float(h[g]),
            max_entropy=float(math.log(max(allowed, 1))), top_action=token_names[int(dist[g].argmax())],
            mean_state_entropy=None if state_entropy_sum is None else float(state_entropy_sum[g] / size[g])))
    return out


def _entropy_verdict(overall: float, source: str) -> str:
    what = "logged actions" if source == "logged" else "the policy's actions"
    if overall < LOW_ENTROPY:
        return (f"entropy of {what} is {overall:.2f} nats (< {LOW_ENTROPY}): exploration is narrow — "
                "check whether the masks are too strict")
    return f"entropy of {what} is {overall:.2f} nats (≥ {LOW_ENTROPY}): the actions are varied"


def _entropy_summary(overall: float, source: str) -> str:
    """:func:`_entropy_verdict` in plain words."""
    who = "The agent" if source == "logged" else "The policy"
    if overall < LOW_ENTROPY:
        return (f"{who} keeps to a few actions (little variety): it explores narrowly — check whether "
                "the action masks are too strict.")
    return f"{who} uses a healthy variety of actions."


def action_entropy(action_tokens: np.ndarray, tokens: Sequence[Any], clusters: np.ndarray | None = None) -> EntropyReport:
    """Entropy of logged actions: overall, per tool (over that tool's tokens) and per cluster.

    ``action_tokens`` [N] are catalog ids (``INVALID_TOKEN`` steps are counted in
    ``n_invalid`` and left out: they are not actions the catalog offers)."""
    a = np.asarray(action_tokens, dtype=np.int64)
    n_actions = len(tokens)
    valid = (a >= 0) & (a < n_actions)
    a_ok = a[valid]
    names = [getattr(t, "name", str(i)) for i, t in enumerate(tokens)]
    counts = np.bincount(a_ok, minlength=n_actions).astype(np.float64)
    tool_names = _token_tools(tokens)
    tools = sorted(set(tool_names))
    tool_of = np.array([tools.index(t) for t in tool_names], dtype=np.int64)
    by_tool = np.zeros((len(tools), n_actions))
    by_tool[tool_of, np.arange(n_actions)] = counts
    per_tool = _groups_entropy(by_tool, tools, names, tool_of, len(tools), tools)
    per_cluster: list[GroupEntropy] = []
    conditional = None
    if clusters is not None:
        c = np.asarray(clusters, dtype=np.int64)[valid]
        k = int(c.max()) + 1 if len(c) else 0
        table = np.zeros((k, n_actions))
        np.add.at(table, (c, a_ok), 1.0)
        per_cluster = _groups_entropy(table, [], names, np.zeros(0, np.int64), k,
                                      [f"cluster {i}" for i in range(k)])
        if len(a_ok):
            conditional = float((shannon_entropy(table, axis=1) * table.sum(axis=1)).sum() / len(a_ok))
    overall = float(shannon_entropy(counts)) if len(a_ok) else 0.0
    return EntropyReport(source="logged", n=float(len(a_ok)), overall=overall,
                         max_overall=float(math.log(max(n_actions, 1))), per_tool=per_tool,
                         per_cluster=per_cluster, conditional=conditional,
                         n_invalid=int((~valid).sum()), verdict=_entropy_verdict(overall, "logged"),
                         summary=_entropy_summary(overall, "logged"))


def policy_entropy(probs: np.ndarray, tokens: Sequence[Any], clusters: np.ndarray | None = None) -> EntropyReport:
    """Entropy of a policy's action distributions ``probs`` [N, A] (rows sum to 1).

    ``overall`` is the entropy of the marginal (mean) distribution, comparable with
    :func:`action_entropy` of logged data; ``mean_state_entropy`` averages the per-state
    entropies.  Per tool: the entropy of the probability mass the policy puts on that
    tool's tokens; per cluster: of the cluster's mean distribution."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] != len(tokens):
        raise InputError(f"policy probabilities must be [N, {len(tokens)}], got {p.shape}")
    if (p < 0).any() or not np.allclose(p.sum(axis=1), 1.0, atol=1e-4):
        raise InputError("policy probabilities must be non-negative and sum to 1 per state")
    n, n_actions = p.shape
    names = [getattr(t, "name", str(i)) for i, t in enumerate(tokens)]
    state_h = shannon_entropy(p, axis=1)
    mass = p.sum(axis=0)
    tool_names = _token_tools(tokens)
    tools = sorted(set(tool_names))
    tool_of = np.array([tools.index(t) for t in tool_names], dtype=np.int64)
    by_tool = np.zeros((len(tools), n_actions))
    by_tool[tool_of, np.arange(n_actions)] = mass
    per_tool = _groups_entropy(by_tool, tools, names, tool_of, len(tools), tools)
    per_cluster: list[GroupEntropy] = []
    conditional = None
    if clusters is not None:
        c = np.asarray(clusters, dtype=np.int64)
        k = int(c.max()) + 1 if n else 0
        table = np.zeros((k, n_actions))
        np.add.at(table, c, p)
        h_sum = np.bincount(c, weights=state_h, minlength=k)
        per_cluster = _groups_entropy(table, [], names, np.zeros(0, np.int64), k,
                                      [f"cluster {i}" for i in range(k)], state_entropy_sum=h_sum)
        conditional = float((shannon_entropy(table, axis=1) * table.sum(axis=1)).sum() / n) if n else None
    overall = float(shannon_entropy(mass)) if n else 0.0
    return EntropyReport(source="policy", n=float(n), overall=overall,
                         max_overall=float(math.log(max(n_actions, 1))), per_tool=per_tool,
                         per_cluster=per_cluster, conditional=conditional,
                         mean_state_entropy=float(state_h.mean()) if n else None,
                         verdict=_entropy_verdict(overall, "policy"),
                         summary=_entropy_summary(overall, "policy"))


def state_clusters(X: np.ndarray, k: int = 8, seed: int = 0, pca_dims: int = 50) -> np.ndarray:
    """[N] k-means cluster of each state (on its PCA projection, for speed)."""
    from sklearn.cluster import KMeans

    X = np.asarray(X)
    if X.shape[0] < k:
        raise InputError(f"cannot form {k} state clusters from {X.shape[0]} states; use fewer clusters",
                         field="clusters")
    reduced, _, _ = pca_reduce(X, pca_dims, seed)
    return KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(reduced).astype(np.int64)


# --------------------------------------------------------------------------- step metadata
@dataclass
class StepRewards:
    """Per-step rewards to show on the map and feed the trace: the total and, optionally,
    named components (pyramid components or levels), all aligned with the steps."""

    total: np.ndarray
    components: dict[str, np.ndarray] = field(default_factory=dict)

    def digest(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.total, dtype=np.float32).tobytes())
        for name in sorted(self.components):
            h.update(name.encode())
            h.update(np.ascontiguousarray(self.components[name], dtype=np.float32).tobytes())
        return h.hexdigest()


def reward_levels(total: np.ndarray) -> np.ndarray:
    """Each step's reward as "low" / "medium" / "high": the terciles over all steps."""
    q1, q2 = np.quantile(total, [1 / 3, 2 / 3])
    labels = np.array([f"low (≤ {q1:.3g})", f"medium ({q1:.3g} … {q2:.3g})", f"high (> {q2:.3g})"],
                      dtype=object)
    return labels[np.where(total <= q1, 0, np.where(total <= q2, 1, 2))]


def pyramid_rewards(result: Any, raw: RawStateFeatures) -> StepRewards:
    """Per-step rewards of a scored reward pyramid (``core.rewards.score``), aligned with
    the steps of ``raw``: the total, each level's gated total (``L1``…) and the penalties."""
    frame = result.frame
    if list(frame.episode_ids) != list(raw.episode_ids) or not np.array_equal(frame.t, raw.step_t):
        raise InputError("the scored steps do not line up with the state features; "
                         "score the same dataset or file")
    levels = {lv.key: result.level_totals[:, i] for i, lv in enumerate(result.template.levels)}
    return StepRewards(total=np.asarray(result.step_reward, dtype=np.float64),
                       components={**levels, "penalties": np.asarray(result.penalties)})


@dataclass
class StateSource:
    """The steps behind a map: raw features, the catalog, and per-step labels."""

    name: str
    raw: RawStateFeatures
    catalog: Any
    #: Per-step columns: episode_id, t, action, tool, task_type, intent, behaviour,
    #: final_reward, resolved.
    steps: dict[str, list[Any]]


def _episode_columns(raw: RawStateFeatures, episodes: dict[str, list[Any]], kinds: list[str],
                     tools: list[str | None], catalog: Any) -> dict[str, list[Any]]:
    """Per-step columns from per-episode ones (gathered by ``step_episode``)."""
    ep = raw.step_episode
    labels = [getattr(t, "label", getattr(t, "name", str(i))) for i, t in enumerate(catalog.tokens)]
    action = [labels[a] if a >= 0 else f"INVALID {tool or kind}"
              for a, kind, tool in zip(raw.action_token.tolist(), kinds, tools)]
    cols: dict[str, list[Any]] = {"episode_id": [raw.episode_ids[e] for e in ep.tolist()],
                                  "t": raw.step_t.tolist(), "action": action,
                                  "tool": [tool or f"({kind})" for kind, tool in zip(kinds, tools)]}
    for name, values in episodes.items():
        cols[name] = [values[e] for e in ep.tolist()]
    return cols


def _intent_label(intents: Any) -> str:
    if isinstance(intents, str):
        try:
            intents = json.loads(intents)
        except ValueError:
            intents = [intents]
    return "+".join(sorted(str(x) for x in intents)) if intents else "(none)"


def load_state_source(ws: Any, *, dataset: str | None = None, episodes_file: str | Path | None = None) -> StateSource:
    """Raw features (cached in the workspace) and per-step labels of a dataset or a file."""
    if (dataset is None) == (episodes_file is None):
        raise InputError("give exactly one of a dataset name or an episodes file")
    if dataset is not None:
        require_dataset(ws, dataset)
        catalog = catalog_for_dataset(ws, dataset)
        raw = raw_features_for_dataset(ws, dataset, catalog)
        rows = ws.conn.execute(
            "SELECT episode_id, task_type, behaviour, final_reward, resolved, "
            "json_extract(body, '$.task.intents') FROM episodes WHERE dataset=? ORDER BY uid",
            (dataset,)).fetchall()
        steps = ws.conn.execute(
            "SELECT s.kind, s.tool FROM steps s JOIN episodes e ON e.uid = s.episode_uid "
            "WHERE e.dataset=? ORDER BY e.uid, s.t", (dataset,)).fetchall()
        by_episode = {
            "task_type": [r[1] for r in rows], "behaviour": [r[2] for r in rows],
            "final_reward": [r[3] for r in rows],
            "resolved": [None if r[4] is None else bool(r[4]) for r in rows],
            "intent": [_intent_label(r[5]) for r in rows]}
        kinds, tools = [s[0] for s in steps], [s[1] for s in steps]
        name = dataset
    else:
        path = Path(episodes_file)  # type: ignore[arg-type]
        if not path.exists():
            raise InputError(f"no such episodes file: {path}", file=str(path))
        parsed = read_file(path)
        episodes = list(parsed.episodes)
        if not episodes:
            raise InputError("the file holds no episodes", file=str(path))
        catalog = build_catalog(list(parsed.tools), episodes)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        raw = cached_features(ws, f"file-{path.stem}-{digest}", episodes, catalog)
        by_episode = {
            "task_type": [e.task.task_type for e in episodes], "behaviour": [e.behaviour for e in episodes],
            "final_reward": [e.outcome.final_reward for e in episodes],
            "resolved": [e.outcome.resolved for e in episodes],
            "intent": [_intent_label(e.task.intents) for e in episodes]}
        kinds = [s.action.kind for e in episodes for s in e.steps]
        tools = [s.action.tool for e in episodes for s in e.steps]
        name = str(path)
    if len(kinds) != raw.n_steps:  # pragma: no cover - the cache is keyed by content
        raise InputError(f"cached state features of {name} are stale; delete artifacts/states and retry")
    return StateSource(name=name, raw=raw, catalog=catalog,
                       steps=_episode_columns(raw, by_episode, kinds, tools, catalog))


# --------------------------------------------------------------------------- the map report
#: Colour fields every map offers; reward and curriculum fields appear when given.
BASE_COLORS = ("task_type", "intent", "behaviour", "action", "tool", "cluster", "final_reward", "resolved")
#: Colour fields holding a number per point (drawn on a colour scale), besides each ``reward:…``.
NUMERIC_COLORS = {"final_reward", "reward_total", "t", "curriculum_level"}
_NUMERIC_COLUMNS = ("t", "cluster", "final_reward", "reward_total", "curriculum_level")


@dataclass(frozen=True)
class StateMapSummary:
    """A state map's figures without its points (:meth:`StateMapReport.summary`)."""

    #: The dataset's or episodes file's name.
    source: str
    #: "encoded" or "raw".
    space: str
    #: All steps of the source.
    n_steps: int
    #: Steps on the map (a seeded sample of at most ``max_points``).
    n_points: int
    fidelity: Fidelity
    entropy: EntropyReport
    #: Seconds per stage (features_s, encode_s, …; cached: 1.0 when read from the cache).
    timings: dict[str, float]
    #: The settings the map was computed with (space, encoder, tsne, max_points, clusters).
    settings: dict[str, Any]
    #: Fields the map can be coloured by.
    color_fields: list[str]
    #: The CSV file the map's points were written to (None: not written).
    out: str | None = None


@dataclass
class StateMapReport:
    """Everything the State Explorer shows for one set of steps."""

    source: str
    space: str                       # "encoded" or "raw"
    n_steps: int                     # all steps of the source
    index: np.ndarray                # [M] steps on the map (flat step indices)
    coords: np.ndarray               # [M, 2]
    columns: dict[str, list[Any]]    # per point on the map
    fidelity: Fidelity
    entropy: EntropyReport
    timings: dict[str, float]
    settings: dict[str, Any]

    def color_fields(self) -> list[str]:
        """Fields the map can be coloured by (those with data)."""
        out = [c for c in BASE_COLORS if c in self.columns and any(v is not None for v in self.columns[c])]
        out += [c for c in self.columns if (c.startswith("reward") or c == "curriculum_level") and c not in out]
        return out

    def check_color(self, color: str) -> None:
        """Refuse a colour the map has no data for (see :meth:`color_fields`)."""
        fields = self.color_fields()
        if color not in fields:
            raise InputError(f"cannot colour by {color!r}; choose one of: {', '.join(fields)}", field="color")

    def color_is_numeric(self, color: str) -> bool:
        """Whether ``color`` holds a number per point (a colour scale) rather than a label (a legend)."""
        return color in NUMERIC_COLORS or color.startswith("reward:")

    def points(self) -> pd.DataFrame:
        """One row per step on the map: its flat step index (``step``), its map coordinates
        (``x``, ``y``) and every per-point field (episode_id, t, action, tool, labels, cluster,
        and the rewards when the steps were scored)."""
        return pd.DataFrame({"step": self.index.astype(np.int64), "x": self.coords[:, 0],
                             "y": self.coords[:, 1], **self.columns})

    def write_points(self, out: str | Path) -> Path:
        """Write :meth:`points` as a CSV file (what ``rwb states map --out`` writes)."""
        out = _points_path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        frame = self.points()
        return write_atomic(out, lambda tmp: frame.to_csv(tmp, index=False))

    def summary(self, out: str | Path | None = None) -> "StateMapSummary":
        """The map's figures without its points (what ``rwb states map --json`` prints);
        ``out``: the CSV file its points were written to."""
        return StateMapSummary(source=self.source, space=self.space, n_steps=self.n_steps,
                               n_points=int(len(self.index)), fidelity=self.fidelity, entropy=self.entropy,
                               timings=dict(self.timings), settings=dict(self.settings),
                               color_fields=self.color_fields(), out=None if out is None else str(out))

    # ------------------------------------------------------------------ artifact cache
    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        num = {c: np.array([np.nan if v is None else float(v) for v in self.columns[c]], dtype=np.float64)
               for c in self.columns if c in _NUMERIC_COLUMNS or c.startswith("reward:")}
        arrays = {"index": self.index.astype(np.int64), "coords": self.coords.astype(np.float64),
                  **{f"col:{k}": v for k, v in num.items()}}
        write_atomic(path.with_name(path.name + ".safetensors"), lambda tmp: save_file(arrays, str(tmp)))
        text_cols = {c: v for c, v in self.columns.items() if c not in num}
        meta = {"version": MAP_VERSION, "source": self.source, "space": self.space, "n_steps": self.n_steps,
                "text_columns": text_cols, "fidelity": self.fidelity.to_dict(),
                "entropy": self.entropy.to_dict(), "timings": self.timings, "settings": self.settings}
        text = json.dumps(meta, default=str)
        write_atomic(path.with_name(path.name + ".json"), lambda tmp: tmp.write_text(text))

    @classmethod
    def load(cls, path: Path) -> "StateMapReport":
        from safetensors.numpy import load_file

        meta = json.loads(path.with_name(path.name + ".json").read_text())
        arrays = load_file(str(path.with_name(path.name + ".safetensors")))
        columns: dict[str, list[Any]] = dict(meta["text_columns"])
        for k, v in arrays.items():
            if k.startswith("col:"):
                name = k[4:]
                vals = [None if np.isnan(x) else x for x in v.tolist()]
                if name in ("t", "cluster", "curriculum_level"):
                    vals = [None if x is None else int(x) for x in vals]
                columns[name] = vals
        e = meta["entropy"]
        entropy = EntropyReport(**{**e, "per_tool": [GroupEntropy(**g) for g in e["per_tool"]],
                                   "per_cluster": [GroupEntropy(**g) for g in e["per_cluster"]]})
        return cls(source=meta["source"], space=meta["space"], n_steps=int(meta["n_steps"]),
                   index=arrays["index"], coords=arrays["coords"], columns=columns,
                   fidelity=Fidelity(**meta["fidelity"]), entropy=entropy, timings=meta["timings"],
                   settings=meta["settings"])


def _points_path(out: str | Path) -> Path:
    """The CSV file the map's points go to; any other kind of file is refused."""
    out = Path(out)
    if out.suffix.lower() != ".csv":
        raise InputError(f"the map's points are written as CSV, so the output file must end in .csv "
                         f"(got {out.name}); the State Explorer page (rwb app) draws the map", field="out")
    return out


def _state_matrix(raw: RawStateFeatures, space: str, encoder_config: StateEncoderConfig,
                  rewards: np.ndarray | None, intent: bool = True,
                  index: np.ndarray | None = None) -> np.ndarray:
    """The states of steps ``index`` (all when None) in the chosen space."""
    if space == "raw":
        return raw.raw_matrix(rewards, intent=intent, index=index)
    if space == "encoded":
        cfg = encoder_config if intent else StateEncoderConfig(**{**asdict(encoder_config), "intent": "off"})
        return encode_states(raw, cfg, rewards=rewards, index=index)
    raise InputError(f"space must be 'encoded' or 'raw', not {space!r}", field="space")


def states_map(ws: Any, *, dataset: str | None = None, episodes_file: str | Path | None = None,
               out: str | Path | None = None, space: str = "encoded",
               encoder: StateEncoderConfig | None = None, tsne: TsneConfig | None = None,
               max_points: int = 20000, clusters: int = 8, template: str | Path | None = None,
               rewards: StepRewards | None = None, curriculum_level: np.ndarray | None = None,
               use_cache: bool = True, progress: Any = None) -> StateMapReport:
    """Map the states of a dataset (or an episodes file), judge the encoding, measure entropy.

    The states are the seeded encoder's output (``space="encoded"``) or the plain
    concatenated raw features (``"raw"``).  At most ``max_points`` steps (a seeded
    random sample) go on the map and into the fidelity check; entropy uses all steps.
    Per-step rewards feed the trace and the reward colours: ``template`` scores the steps
    with that reward pyramid (a shipped name such as ``finance_risk`` or a file), or
    ``rewards`` gives them directly; without either the trace rewards are zero.  The
    result is cached in the workspace (``artifacts/states/maps``), so a big map is
    computed once; ``out`` writes the map's points as CSV (:meth:`StateMapReport.write_points`).
    """
    report_progress = progress or (lambda _msg: None)
    encoder = encoder or StateEncoderConfig()
    tsne = tsne or TsneConfig(seed=encoder.seed)
    if max_points < 10:
        raise InputError("max_points must be at least 10", field="max_points")
    if out is not None:
        _points_path(out)   # a wrong kind of file is refused before the map is computed
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    report_progress("reading features")
    src = load_state_source(ws, dataset=dataset, episodes_file=episodes_file)
    raw = src.raw
    timings["features_s"] = time.perf_counter() - t0
    if raw.n_steps == 0:
        raise InputError(f"{src.name} has no steps to map")
    if template is not None:
        if rewards is not None:
            raise InputError("give a reward template or per-step rewards, not both", field="template")
        from core.rewards import score  # deferred: loads scipy

        report_progress(f"scoring the steps with the reward template {template}")
        rewards = pyramid_rewards(score(ws, template, dataset=dataset, episodes=episodes_file), raw)
    reward_vec = None
    if rewards is not None:
        reward_vec = raw.check_rewards(rewards.total)
        for name, comp in rewards.components.items():
            raw.check_rewards(comp)
    if curriculum_level is not None and len(curriculum_level) != raw.n_steps:
        raise InputError(f"got {len(curriculum_level)} curriculum levels for {raw.n_steps} steps",
                         field="curriculum_level")
    settings = {"space": space, "encoder": asdict(encoder), "tsne": asdict(tsne), "max_points": max_points,
                "clusters": clusters}
    key_src = json.dumps({"v": MAP_VERSION, "fp": raw.fingerprint, **settings,
                          "rewards": None if rewards is None else rewards.digest(),
                          "curriculum": None if curriculum_level is None else
                          hashlib.sha256(np.asarray(curriculum_level, np.float64).tobytes()).hexdigest()},
                         sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    cache = ws.artifact_dir("states", "maps") / f"map-{key}"
    if use_cache and cache.with_name(cache.name + ".json").exists():
        report = StateMapReport.load(cache)
        report.timings = {**report.timings, "cached": 1.0}
        if out is not None:
            report.write_points(out)
        return report

    # --- states: all steps (entropy clusters), the sample for map and fidelity
    t1 = time.perf_counter()
    report_progress("encoding states")
    X = _state_matrix(raw, space, encoder, reward_vec)
    index = _sample(raw.n_steps, max_points, tsne.seed)
    # the ablation is only compared on the sampled steps
    X_off = _state_matrix(raw, space, encoder, reward_vec, intent=False, index=index)
    timings["encode_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    report_progress("clustering states and measuring entropy")
    k = min(clusters, raw.n_steps)
    cluster = state_clusters(X, k, tsne.seed)
    entropy = action_entropy(raw.action_token, src.catalog.tokens, cluster)
    timings["entropy_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    report_progress("checking fidelity")
    fidelity = state_fidelity(X[index], [src.steps["task_type"][i] for i in index], raw.step_episode[index],
                              X_intent_off=X_off,
                              parts=lambda rows: state_parts(raw, index[rows], intent=encoder.intent == "on"),
                              seed=tsne.seed)
    timings["fidelity_s"] = time.perf_counter() - t3
    t4 = time.perf_counter()
    report_progress(f"t-SNE of {len(index)} states")
    tsne_cfg = tsne
    if len(index) < 3 * tsne.perplexity + 2:   # tiny sources: shrink the perplexity to fit
        tsne_cfg = TsneConfig(**{**asdict(tsne), "perplexity": max(2.0, (len(index) - 2) / 3)})
    fitted = tsne_map(X[index], tsne_cfg)
    timings["tsne_s"] = time.perf_counter() - t4

    columns = {name: [values[i] for i in index] for name, values in src.steps.items()}
    columns["cluster"] = cluster[index].tolist()
    if rewards is not None:
        columns["reward_total"] = np.asarray(rewards.total, dtype=np.float64)[index].tolist()
        columns["reward_level"] = reward_levels(np.asarray(rewards.total, dtype=np.float64))[index].tolist()
        for name, comp in rewards.components.items():
            columns[f"reward:{name}"] = np.asarray(comp, dtype=np.float64)[index].tolist()
    if curriculum_level is not None:
        columns["curriculum_level"] = np.asarray(curriculum_level)[index].astype(int).tolist()
    report = StateMapReport(source=src.name, space=space, n_steps=raw.n_steps, index=index,
                            coords=fitted.coords, columns=columns, fidelity=fidelity, entropy=entropy,
                            timings=timings, settings=settings)
    report.save(cache)
    if out is not None:
        report.write_points(out)
    return report


def states_entropy(ws: Any, *, dataset: str | None = None, episodes_file: str | Path | None = None,
                   clusters: int = 8, encoder: StateEncoderConfig | None = None,
                   rewards: StepRewards | None = None) -> EntropyReport:
    """Entropy of the logged actions of a dataset (or file): overall, per tool, per state cluster."""
    encoder = encoder or StateEncoderConfig()
    src = load_state_source(ws, dataset=dataset, episodes_file=episodes_file)
    if src.raw.n_steps == 0:
        raise InputError(f"{src.name} has no steps")
    reward_vec = None if rewards is None else src.raw.check_rewards(rewards.total)
    X = encode_states(src.raw, encoder, rewards=reward_vec)
    cluster = state_clusters(X, min(clusters, src.raw.n_steps), encoder.seed)
    return action_entropy(src.raw.action_token, src.catalog.tokens, cluster)
