"""The RDE baseline: a decision tree fit on logged expert actions, stored as plain arrays.

The decision engine (docs/design.md §9) answers most requests with this light model and
asks the RL policy only when it is unsure.  :func:`fit_rde` fits a scikit-learn decision
tree on the expert's logged decisions; :class:`RdeModel` keeps the tree's raw arrays and a
JSON description of its features (state keys, task type, step index, previous action), and
predicts for a whole batch in pure numpy, one vectorised step per tree level.  Nothing is
pickled: a bundle carries numbers, never code.

Details: docs/learning.md (## The RDE baseline, ## RDE features, ## RDE prediction).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.records.catalog import Catalog
    from core.records.episodes import Episode

#: Format of ``rde.json``; bump when the feature layout changes.
RDE_FORMAT = 1
#: Label of "no previous action" (the first step of an episode).
NO_PREVIOUS = "<none>"
#: Arrays of the fitted tree, as stored in ``rde.safetensors``.
TREE_ARRAYS = ("children_left", "children_right", "feature", "threshold", "value", "classes")


@dataclass(frozen=True)
class RdeConfig:
    """How the tree is grown (scikit-learn's parameters of the same names)."""

    #: Deepest path from the root; keeps the tree small and its leaves readable.
    max_depth: int = 12
    #: Fewest training decisions in a leaf, so a leaf's probability is not one sample's.
    min_samples_leaf: int = 2
    #: Seed of scikit-learn's tie-breaking between equally good splits.
    seed: int = 0


def action_label(kind: str, tool: str | None) -> str:
    """The ``prev=`` label of an action: its tool for a tool call, else its kind."""
    if kind == "tool_call" and tool:
        return tool
    return "final_answer" if kind == "terminate" else kind


@dataclass(eq=False)
class RdeModel:
    """A fitted decision tree and the description of its input features.

    ``state_keys``/``fill``: numeric state features and their missing-value fill;
    ``task_types``: the one-hot task types; ``prev_labels``: the one-hot previous-action
    labels (``NO_PREVIOUS`` first); ``token_prev``: for every catalog token id, the index
    of its label in ``prev_labels`` (-1 when the tree never saw it).  Tree arrays as in
    scikit-learn's ``tree_``; ``classes``: the catalog token id of each output column."""

    state_keys: list[str]
    fill: np.ndarray
    task_types: list[str]
    prev_labels: list[str]
    token_prev: np.ndarray
    children_left: np.ndarray
    children_right: np.ndarray
    feature: np.ndarray
    threshold: np.ndarray
    value: np.ndarray
    classes: np.ndarray
    catalog_version: str
    config: RdeConfig
    trained_on: dict[str, Any]
    #: The node arrays as Python lists for :meth:`_leaf` (built on first use).
    _node_lists: tuple[tuple[np.ndarray, ...], tuple[list, ...]] | None = field(
        default=None, init=False, repr=False)
    #: ``fill`` as a Python list for :meth:`_featurize_one` (built on first use).
    _fill_cache: tuple[np.ndarray, list[float]] | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------ features
    @property
    def feature_names(self) -> list[str]:
        """Column names of :meth:`featurize`'s matrix, in order."""
        return ([f"state.{k}" for k in self.state_keys] + [f"task_type={t}" for t in self.task_types]
                + ["step_t"] + [f"prev={p}" for p in self.prev_labels])

    @property
    def n_features(self) -> int:
        return len(self.state_keys) + len(self.task_types) + 1 + len(self.prev_labels)

    @property
    def depth(self) -> int:
        """Depth of the fitted tree (root only = 0)."""
        depth = np.zeros(len(self.children_left), dtype=np.int64)
        for node in range(len(self.children_left)):  # parents precede children in sklearn's order
            for child in (self.children_left[node], self.children_right[node]):
                if child >= 0:
                    depth[child] = depth[node] + 1
        return int(depth.max()) if len(depth) else 0

    def featurize(self, states: Sequence[Mapping[str, Any] | None], task_types: Sequence[str | None],
                  step_t: Sequence[int] | np.ndarray, prev_tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[B, F]`` float64 feature matrix of B decisions.

        ``states``: each decision's ``observation["state"]`` (None = nothing known);
        ``prev_tokens``: the catalog token id of the previous action (negative = none:
        the first step, or an INVALID call whose label is unknown)."""
        B = len(states)
        if not (len(task_types) == B and len(step_t) == B and len(prev_tokens) == B):
            raise InputError(f"featurize needs one task type, step index and previous token per state "
                             f"(got {B} states, {len(task_types)} task types, {len(step_t)} step "
                             f"indices, {len(prev_tokens)} previous tokens)")
        if B == 1:
            return self._featurize_one(states[0], task_types[0], int(step_t[0]), int(prev_tokens[0]))
        X = np.zeros((B, self.n_features), dtype=np.float64)
        S = len(self.state_keys)
        for j, key in enumerate(self.state_keys):
            X[:, j] = [_number(s.get(key)) if s else math.nan for s in states]
        X[:, :S] = np.where(np.isnan(X[:, :S]), self.fill[None, :], X[:, :S])
        type_index = {t: i for i, t in enumerate(self.task_types)}
        rows = np.array([type_index.get(t, -1) if t is not None else -1 for t in task_types], np.int64)
        hit = rows >= 0
        X[np.flatnonzero(hit), S + rows[hit]] = 1.0
        X[:, S + len(self.task_types)] = np.asarray(step_t, dtype=np.float64)
        prev = np.asarray(prev_tokens, dtype=np.int64).reshape(-1)
        if ((prev >= len(self.token_prev))).any():
            raise InputError(f"previous token ids must lie below {len(self.token_prev)} (the catalog's size)",
                             field="prev_tokens")
        # negative ids (no previous step / INVALID) read as <none>; tokens never seen: all 0
        label = np.where(prev < 0, 0, self.token_prev[np.maximum(prev, 0)])
        off = S + len(self.task_types) + 1
        ok = label >= 0
        X[np.flatnonzero(ok), off + label[ok]] = 1.0
        return X

    def _featurize_one(self, state: Mapping[str, Any] | None, task_type: str | None, step_t: int,
                       prev: int) -> np.ndarray:
        """:meth:`featurize` of one decision in plain Python (a serving request), the same
        values: one list, one array."""
        if prev >= len(self.token_prev):
            raise InputError(f"previous token ids must lie below {len(self.token_prev)} (the catalog's size)",
                             field="prev_tokens")
        fill = self._fill_list()
        row = [0.0] * self.n_features
        for j, key in enumerate(self.state_keys):
            x = _number(state.get(key)) if state else math.nan
            row[j] = fill[j] if math.isnan(x) else x
        S, T = len(self.state_keys), len(self.task_types)
        if task_type is not None and task_type in self.task_types:
            row[S + self.task_types.index(task_type)] = 1.0
        row[S + T] = float(step_t)
        label = 0 if prev < 0 else int(self.token_prev[prev])
        if label >= 0:
            row[S + T + 1 + label] = 1.0
        return np.array([row], dtype=np.float64)

    def _fill_list(self) -> list[float]:
        if self._fill_cache is None or self._fill_cache[0] is not self.fill:  # keyed on the array itself
            self._fill_cache = (self.fill, self.fill.tolist())
        return self._fill_cache[1]

    # ------------------------------------------------------------------ prediction
    def leaves(self, X: np.ndarray) -> np.ndarray:
        """``[B]`` leaf node of every row: the tree walked for the whole batch, one level per
        iteration (sklearn's rule: go left when ``x[feature] <= threshold``)."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise InputError(f"the RDE tree reads {self.n_features} features per row, got shape {X.shape}")
        if X.shape[0] == 1:
            return np.array([self._leaf(X[0].tolist())], dtype=np.int64)
        node = np.zeros(X.shape[0], dtype=np.int64)
        rows = np.arange(X.shape[0])
        # until every row sits on a leaf: at most `depth` levels, without computing the
        # depth (a Python walk over the nodes) on every call — serving predicts per request
        while True:
            left = self.children_left[node]
            inner = left >= 0
            if not inner.any():
                return node
            go_left = X[rows, np.maximum(self.feature[node], 0)] <= self.threshold[node]
            node = np.where(inner, np.where(go_left, left, self.children_right[node]), node)

    def _leaf(self, x: list[float]) -> int:
        """The leaf of one row, walked in plain Python: a serving request is one row, where
        a handful of list look-ups per level beat the batched walk's array calls.  Same rule
        and float64 comparisons as :meth:`leaves`."""
        arrays = (self.children_left, self.children_right, self.feature, self.threshold)
        if self._node_lists is None or any(a is not b for a, b in zip(self._node_lists[0], arrays)):
            # keyed on the arrays themselves: fit_rde and dataclasses.replace swap them
            self._node_lists = (arrays, tuple(a.tolist() for a in arrays))
        left, right, feature, threshold = self._node_lists[1]
        node = 0
        while left[node] >= 0:
            node = left[node] if x[feature[node]] <= threshold[node] else right[node]
        return node

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """``[B, len(classes)]`` class probabilities (the leaf's class shares)."""
        v = self.value[self.leaves(X)]
        return v / np.maximum(v.sum(axis=1, keepdims=True), 1e-12)

    def predict(self, X: np.ndarray, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(token_ids [B], confidence [B])``: the most probable token and its leaf probability.

        With ``mask`` (``[B, A]`` bool over the catalog) only allowed tokens compete; a row
        whose leaf gives every allowed token probability 0 answers token -1 with confidence
        0 (the caller decides: the policy, or escalation)."""
        proba = self.predict_proba(X)
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if mask.ndim != 2 or mask.shape[0] != proba.shape[0] or int(self.classes.max(initial=-1)) >= mask.shape[1]:
                raise InputError(f"mask must be [B, A] over the catalog; got {mask.shape}", field="mask")
            proba = np.where(mask[:, self.classes], proba, 0.0)
        best = proba.argmax(axis=1)
        conf = proba[np.arange(len(best)), best]
        tokens = np.where(conf > 0, self.classes[best], -1)
        return tokens, conf

    # ------------------------------------------------------------------ persistence
    def arrays(self) -> dict[str, np.ndarray]:
        """The tree as named numpy arrays (``rde.safetensors``)."""
        return {"children_left": self.children_left.astype(np.int64),
                "children_right": self.children_right.astype(np.int64),
                "feature": self.feature.astype(np.int64), "threshold": self.threshold.astype(np.float64),
                "value": self.value.astype(np.float64), "classes": self.classes.astype(np.int64),
                "fill": self.fill.astype(np.float64), "token_prev": self.token_prev.astype(np.int64)}

    def meta(self) -> dict[str, Any]:
        """Everything that is not an array (``rde.json``)."""
        return {"rwb_rde": RDE_FORMAT, "model": "sklearn.tree.DecisionTreeClassifier",
                "catalog_version": self.catalog_version, "state_keys": self.state_keys,
                "task_types": self.task_types, "prev_labels": self.prev_labels,
                "feature_names": self.feature_names,
                "config": {"max_depth": self.config.max_depth,
                           "min_samples_leaf": self.config.min_samples_leaf, "seed": self.config.seed},
                "n_nodes": int(len(self.children_left)), "depth": self.depth, "trained_on": self.trained_on}

    def save(self, folder: str | Path) -> tuple[Path, Path]:
        """Write ``rde.safetensors`` and ``rde.json`` into ``folder``."""
        from safetensors.numpy import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in self.arrays().items()}, str(folder / "rde.safetensors"))
        (folder / "rde.json").write_text(json.dumps(self.meta(), indent=2, sort_keys=True) + "\n",
                                         encoding="utf-8")
        return folder / "rde.safetensors", folder / "rde.json"

    @classmethod
    def from_parts(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> "RdeModel":
        """Rebuild from :meth:`meta` and :meth:`arrays`; inconsistent shapes are refused."""
        if meta.get("rwb_rde") != RDE_FORMAT:
            raise InputError(f"rde.json has format {meta.get('rwb_rde')!r}; this Reward Workbench reads "
                             f"{RDE_FORMAT}", file="rde.json", field="rwb_rde")
        missing = [k for k in (*TREE_ARRAYS, "fill", "token_prev") if k not in arrays]
        if missing:
            raise InputError(f"rde.safetensors lacks {', '.join(missing)}", file="rde.safetensors")
        try:
            cfg = meta["config"]
            model = cls(state_keys=[str(k) for k in meta["state_keys"]], fill=np.asarray(arrays["fill"], np.float64),
                        task_types=[str(t) for t in meta["task_types"]],
                        prev_labels=[str(p) for p in meta["prev_labels"]],
                        token_prev=np.asarray(arrays["token_prev"], np.int64),
                        children_left=np.asarray(arrays["children_left"], np.int64),
                        children_right=np.asarray(arrays["children_right"], np.int64),
                        feature=np.asarray(arrays["feature"], np.int64),
                        threshold=np.asarray(arrays["threshold"], np.float64),
                        value=np.asarray(arrays["value"], np.float64),
                        classes=np.asarray(arrays["classes"], np.int64),
                        catalog_version=str(meta["catalog_version"]),
                        config=RdeConfig(int(cfg["max_depth"]), int(cfg["min_samples_leaf"]), int(cfg["seed"])),
                        trained_on=dict(meta.get("trained_on") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"rde.json is malformed: {exc}", file="rde.json") from None
        model.check()
        return model

    def check(self) -> None:
        """Refuse a tree whose arrays do not form a tree over these features."""
        n = len(self.children_left)
        problems = []
        if n == 0:
            problems.append("no nodes")
        if not (len(self.children_right) == len(self.feature) == len(self.threshold) == n
                and self.value.ndim == 2 and self.value.shape[0] == n):
            problems.append("node arrays differ in length")
        elif self.value.shape[1] != len(self.classes):
            problems.append("value columns differ from classes")
        if len(self.fill) != len(self.state_keys):
            problems.append("one fill value per state key is needed")
        if len(self.prev_labels) == 0 or self.prev_labels[0] != NO_PREVIOUS:
            problems.append(f"prev_labels must start with {NO_PREVIOUS}")
        if not problems:
            inner = self.children_left >= 0
            parents = np.concatenate([np.flatnonzero(inner)] * 2)
            kids = np.concatenate([self.children_left[inner], self.children_right[inner]])
            if ((self.children_right >= 0) != inner).any():
                problems.append("a node has one child")
            elif (kids >= n).any() or len(np.unique(kids)) != len(kids) or len(kids) != n - 1:
                problems.append("child indices do not form a tree")
            elif (kids <= parents).any():
                # sklearn numbers a child after its parent; the predictor's walk relies on it
                problems.append("a child precedes its parent")
            elif ((self.feature[inner] < 0) | (self.feature[inner] >= self.n_features)).any():
                problems.append("a split reads a feature the model does not have")
            elif not np.isfinite(self.value).all() or (self.value < 0).any():
                problems.append("leaf values must be finite and non-negative")
            elif ((self.token_prev < -1) | (self.token_prev >= len(self.prev_labels))).any():
                problems.append("token_prev points outside prev_labels")
        if problems:
            raise InputError(f"the RDE tree is malformed: {'; '.join(problems)}", file="rde.safetensors")

    @classmethod
    def load(cls, folder: str | Path) -> "RdeModel":
        """Read what :meth:`save` wrote (safetensors and JSON only)."""
        from safetensors.numpy import load_file

        folder = Path(folder)
        meta = json.loads((folder / "rde.json").read_text(encoding="utf-8"))
        return cls.from_parts(meta, load_file(str(folder / "rde.safetensors")))


def _number(v: Any) -> float:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return math.nan


# --------------------------------------------------------------------------- fitting
def decisions_of(episodes: Sequence["Episode"], catalog: "Catalog"
                 ) -> tuple[list[dict[str, Any] | None], list[str | None], np.ndarray, np.ndarray, np.ndarray]:
    """Every logged step as an RDE decision: ``(states, task_types, step_t, prev_tokens,
    tokens)`` — the token the step logged (-1 = INVALID) and the one logged before it."""
    steps = [(ep, s) for ep in episodes for s in ep.steps]
    tokens = (np.asarray(catalog.normalize_many([s.action for _, s in steps]).token_ids, np.int64)
              if steps else np.zeros(0, np.int64))
    first = np.array([i == 0 for ep in episodes for i in range(len(ep.steps))], dtype=bool)
    prev = np.concatenate([[-2], tokens[:-1]]) if len(tokens) else tokens
    prev = np.where(first, -2, prev)
    states = [(s.observation.get("state") if isinstance(s.observation, dict) else None) for _, s in steps]
    states = [st if isinstance(st, dict) else None for st in states]
    task_types = [ep.task.task_type for ep, _ in steps]
    step_t = np.array([i for ep in episodes for i in range(len(ep.steps))], dtype=np.int64)
    return states, task_types, step_t, prev, tokens


def fit_rde(episodes: Sequence["Episode"], catalog: "Catalog", *, config: RdeConfig | None = None,
            trained_on: Mapping[str, Any] | None = None) -> RdeModel:
    """Fit the baseline tree on the logged actions of ``episodes`` (the caller picks the
    expert ones).  Steps whose action is INVALID in the catalog are left out."""
    from sklearn.tree import DecisionTreeClassifier

    config = config or RdeConfig()
    states, task_types, step_t, prev, tokens = decisions_of(episodes, catalog)
    keep = tokens >= 0
    if not keep.any():
        raise InputError("no valid logged action to fit the RDE baseline on", field="episodes")
    state_keys = sorted({k for s in states if s for k, v in s.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
    raw = np.array([[_number(s.get(k)) if s else math.nan for k in state_keys] for s in states],
                   dtype=np.float64).reshape(len(states), len(state_keys))
    fill = np.array([float(np.nanmedian(col)) if np.isfinite(col).any() else 0.0 for col in raw.T])
    labels = [action_label(t.kind, t.tool) for t in catalog.tokens]
    prev_labels = [NO_PREVIOUS] + sorted({labels[t] for t in tokens[keep]})
    index = {p: i for i, p in enumerate(prev_labels)}
    token_prev = np.array([index.get(lbl, -1) for lbl in labels], dtype=np.int64)
    model = RdeModel(state_keys=state_keys, fill=fill, task_types=sorted({t for t in task_types if t is not None}),
                     prev_labels=prev_labels, token_prev=token_prev, children_left=np.zeros(1, np.int64),
                     children_right=np.zeros(1, np.int64), feature=np.zeros(1, np.int64),
                     threshold=np.zeros(1), value=np.zeros((1, 1)), classes=np.zeros(1, np.int64),
                     catalog_version=str(catalog.version), config=config, trained_on=dict(trained_on or {}))
    X = model.featurize(states, task_types, step_t, prev)[keep]
    y = tokens[keep]
    tree = DecisionTreeClassifier(max_depth=config.max_depth, min_samples_leaf=config.min_samples_leaf,
                                  random_state=config.seed).fit(X, y)
    t = tree.tree_
    model.children_left = t.children_left.astype(np.int64)
    model.children_right = t.children_right.astype(np.int64)
    model.feature = t.feature.astype(np.int64)
    model.threshold = t.threshold.astype(np.float64)
    model.value = t.value[:, 0, :].astype(np.float64)
    model.classes = tree.classes_.astype(np.int64)
    model.trained_on = {**model.trained_on, "decisions": int(keep.sum()),
                        "train_accuracy": float((model.predict(X)[0] == y).mean())}
    model.check()
    return model


@dataclass(frozen=True)
class RdeAccuracy:
    """How well the RDE tree predicts the logged actions of some episodes (:func:`rde_accuracy`)."""

    #: Logged decisions scored (steps whose call maps onto a catalog token)
    decisions: int
    #: Share of those where the tree's choice is the logged token (None without decisions)
    accuracy: float | None
    #: The tree's mean confidence in its choice (None without decisions)
    mean_confidence: float | None


def rde_accuracy(model: RdeModel, episodes: Sequence["Episode"], catalog: "Catalog") -> RdeAccuracy:
    """How often the tree picks the logged action on ``episodes`` (e.g. held-out expert
    ones), and its mean confidence."""
    states, task_types, step_t, prev, tokens = decisions_of(episodes, catalog)
    keep = tokens >= 0
    if not keep.any():
        return RdeAccuracy(decisions=0, accuracy=None, mean_confidence=None)
    pred, conf = model.predict(model.featurize(states, task_types, step_t, prev)[keep])
    return RdeAccuracy(decisions=int(keep.sum()), accuracy=float((pred == tokens[keep]).mean()),
                       mean_confidence=float(conf.mean()))
