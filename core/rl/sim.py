"""The recorded-episode simulator (docs/design.md §7): training against logged data, not a live system.

An environment stands on one recorded step of a dataset and, when it acts, follows the log,
jumps to a recorded step where another action was taken in a similar state (counterfactual),
or earns ``off_support_penalty`` when no such step exists; its rewards sum to the template's
episode return.  Entry points: :func:`build_sim_tables` (everything precomputed once as
:class:`SimTables`), :class:`BatchedSim` (B environments as tensors on one device, stepped
without a Python loop), :class:`RecordedEpisodeEnv` (the same simulator as a Gymnasium
environment), :func:`split_episodes` and :func:`logged_returns`.

Details: docs/training.md (## The simulator's step, ## Episode ends, ## History-dependent
penalties, ## Simulator rewards, ## Batched simulation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch

from core.records.catalog import Catalog, build_catalog, catalog_for_dataset
from core.records.episodes import Episode, ToolSchema
from core.base.errors import InputError
from core.guard.masking import CompiledMasks, MaskRules, state_features
from core.rl.env import TensorSpec
from core.state.features import (PAD_TOKEN, RawStateFeatures, TRACE_LEN, extract_features, raw_features_for_dataset,
                                 require_dataset)
from core.base.embed import Embedder
from core.guard.review import with_review_rules

#: Keys of an observation batch (the input of :class:`core.state.features.StateEncoder`).
OBS_KEYS: tuple[str, ...] = ("intent_emb", "intent_rules", "context", "trace_action", "trace_reward",
                             "trace_dt")
#: Random integers are drawn in [0, RANDOM_HIGH) and reduced modulo a count (exact on every
#: device, and the same numbers a slow reference reproduces from the same generator).
RANDOM_HIGH = 2 ** 31


@dataclass
class SimConfig:
    """How recorded episodes become an environment."""

    #: Most steps per episode before it is truncated (S000: 12).
    step_cap: int = 12
    #: Step reward ``r`` (pyramid scale, so the RL reward is ``a·r``) of a counterfactual
    #: action that no recorded step took in a similar state.
    off_support_penalty: float = -0.5
    #: k-means state clusters per task type: "similar state" for counterfactual draws.
    n_clusters: int = 16
    #: Recorded steps per cluster at least: a task type with few steps gets fewer clusters
    #: (on 40 logged episodes, 16 clusters per task type left most counterfactual actions
    #: without support).
    min_cluster_steps: int = 25
    #: R_final of an episode cut at the step cap without an answer: the request was never
    #: answered.  None takes the worst outcome among the recorded episodes — otherwise a
    #: policy could pad every episode to the cap with positively rewarded calls and never
    #: be charged for leaving the user without an answer.
    unanswered_outcome: float | None = None
    #: Counterfactual draws prefer recorded steps whose last ``history_match`` logged
    #: actions are the environment's own last actions (then one fewer, …, then any step of
    #: the bucket).  A state is more alike when the way into it is: without this, a draw
    #: lands as often in an episode that slipped just before (a failed call, a wrong tool)
    #: as in one that took the same path, and inherits its later outcome.
    history_match: int = 2
    #: Seed of the clustering (the environments have their own seed).
    seed: int = 0

    def __post_init__(self) -> None:
        if int(self.step_cap) < 1:
            raise InputError(f"step_cap must be at least 1, not {self.step_cap}", field="step_cap")
        if int(self.n_clusters) < 1:
            raise InputError(f"n_clusters must be at least 1, not {self.n_clusters}", field="n_clusters")
        if int(self.min_cluster_steps) < 1:
            raise InputError(f"min_cluster_steps must be at least 1, not {self.min_cluster_steps}",
                             field="min_cluster_steps")
        if not 0 <= int(self.history_match) <= TRACE_LEN:
            raise InputError(f"history_match must lie in 0..{TRACE_LEN}, not {self.history_match}",
                             field="history_match")
        if not np.isfinite(self.off_support_penalty):
            raise InputError("off_support_penalty must be a finite number", field="off_support_penalty")
        if self.unanswered_outcome is not None and not np.isfinite(self.unanswered_outcome):
            raise InputError("unanswered_outcome must be a finite number (or null: the worst recorded outcome)",
                             field="unanswered_outcome")


# --------------------------------------------------------------------------- tables
@dataclass(eq=False)
class SimTables:
    """Everything the simulator reads, precomputed once per (dataset, template, catalog, masks).

    Steps are flattened in episode order (as in :class:`core.state.features.RawStateFeatures`).
    Tensors live on :attr:`device`; :meth:`to` returns a copy on another device.

    Per step ``[N]``: ``step_episode``, ``step_t``, ``token`` (logged token, -1 = INVALID),
    ``step_reward`` (pyramid total with gating, float32; ``step_reward64`` the same in
    float64 for exact returns), ``components [N, C]`` (weighted, gated contribution of
    every step component; they sum to the step reward), ``step_dt`` (seconds to the next
    logged step), ``cluster`` (state cluster within the task type), ``step_bucket``
    (counterfactual bucket of the logged action, -1 when invalid), ``step_last`` (last step
    of its episode), ``context [N, CONTEXT_DIM]`` (tool context of the state).
    Per episode ``[E]``: ``ep_start``, ``ep_len``, ``ep_end``, ``final`` (R_final),
    ``success`` (resolved, else final_reward > 0, else 0), ``episode_return`` (the
    template's return), ``task_code``, ``intent_emb``, ``intent_rules``.
    Counterfactual table (CSR over bucket ``(task_code·K + cluster)·A + token``):
    ``bucket_offsets [T·K·A + 1]`` and ``bucket_steps`` (recorded steps, sorted by bucket).
    History-matched draws, for k = 1 … ``config.history_match``: ``history_keys_k`` (the
    bucket and the log's last k action tokens as one sorted key, :func:`history_key`) and
    ``history_steps_k`` (the recorded steps in that order).
    """

    n_actions: int
    n_components: int
    component_names: list[str]
    catalog: Catalog
    mask_rules: MaskRules
    compiled_masks: CompiledMasks
    episode_ids: list[str]
    behaviours: list[str | None]
    task_types: list[str | None]
    #: Task of each episode (``core.rewards.outcomes.episode_groups``: the log's own task id,
    #: else task type and request): held-out splits by task and intervals over tasks use it.
    task_ids: list[str]
    gamma: float
    a: float
    b: float
    config: SimConfig
    raw: RawStateFeatures
    #: Scalar state features of every step (``observation["state"]`` + ``task_type``), as
    #: numpy columns: mask rules (also ones added later) are evaluated from them.
    state_columns: dict[str, np.ndarray]
    task_names: list[str | None]
    n_clusters: int
    template_name: str
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> torch.Tensor:
        # Tensors are attributes too (tables.token, tables.bucket_offsets, ...).
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    @property
    def n_steps(self) -> int:
        return int(self.tensors["token"].shape[0])

    @property
    def n_episodes(self) -> int:
        return len(self.episode_ids)

    def to(self, device: str | torch.device) -> "SimTables":
        """These tables with every tensor on ``device`` (self when already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return replace(self, device=device, tensors={k: v.to(device) for k, v in self.tensors.items()})

    def bucket(self, task_code: torch.Tensor, cluster: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Flat counterfactual bucket id of (task type, state cluster, action token)."""
        return (task_code * self.n_clusters + cluster) * self.n_actions + action

    def mask_inputs(self, compiled: CompiledMasks) -> dict[str, torch.Tensor]:
        """Per-step ``[N]`` columns of the features ``compiled`` needs, on :attr:`device`:
        float64 for numeric features (NaN = unknown), int64 codes for categorical ones."""
        n = self.n_steps
        out: dict[str, torch.Tensor] = {}
        for name in compiled.numeric_features:
            col = self.state_columns.get(name)
            if col is None:  # no step has it: unknown everywhere
                arr = np.full(n, np.nan)
            elif col.dtype == object:
                example = next(v for v in col if v is not None and not isinstance(v, (int, float)))
                raise InputError(f"mask rules compare state feature '{name}' with numbers, but the "
                                 f"dataset logs text values for it (e.g. {example!r})", field=name)
            else:
                arr = col.astype(np.float64)
            out[name] = torch.as_tensor(arr, dtype=torch.float64, device=self.device)
        for name in compiled.categorical_features:
            col = self.state_columns.get(name)
            values = [None] * n if col is None else [
                None if v is None or (isinstance(v, float) and np.isnan(v)) else
                (v if isinstance(v, str) else _category_text(v)) for v in col.tolist()]
            out[name] = torch.as_tensor(compiled.codes(name, values), dtype=torch.int64, device=self.device)
        return out

    def logged_batch(self, index: np.ndarray | torch.Tensor | None = None,
                     device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Encoder input of recorded steps with the *log's* trace (behaviour cloning,
        state maps); trace rewards are the pyramid's step rewards."""
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        rewards = self.tensors["step_reward"].cpu().numpy()
        return self.raw.step_batch(index, rewards, self.device if device is None else device)


def _category_text(v: Any) -> str:
    """A numeric value compared as a category (e.g. ``market_open: 1`` vs ``in: ["1"]``)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _as_rules(masks: MaskRules | str | Path | None) -> MaskRules:
    if masks is None:
        return MaskRules(description="no mask rules: every action is allowed")
    if isinstance(masks, MaskRules):
        return masks
    if isinstance(masks, CompiledMasks):
        return masks.rules
    if isinstance(masks, (str, Path)):
        return MaskRules.from_yaml(masks)
    raise InputError(f"masks must be mask rules or a YAML file, not {type(masks).__name__}", field="masks")


def history_key(bucket: torch.Tensor, trace: torch.Tensor, k: int, n_actions: int) -> torch.Tensor:
    """One int64 key of a counterfactual bucket and the last ``k`` actions of a trace
    (newest first; PAD_TOKEN where there was none, -1 an invalid call)."""
    key = bucket.long()
    for j in range(k):
        key = key * (n_actions + 3) + (trace[:, j].long() - PAD_TOKEN)
    return key


def _history_tables(step_bucket: np.ndarray, trace_action: np.ndarray, k: int, n_actions: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(sorted keys, steps)`` of the recorded steps with a valid action, by
    :func:`history_key` of their bucket and their log's last ``k`` actions."""
    steps = np.flatnonzero(step_bucket >= 0)
    keys = history_key(torch.as_tensor(step_bucket[steps]), torch.as_tensor(trace_action[steps]), k,
                       n_actions).numpy()
    order = np.argsort(keys, kind="stable")
    return keys[order], steps[order]


def state_clusters(raw: RawStateFeatures, task_code: np.ndarray, n_clusters: int, seed: int = 0,
                   min_cluster_steps: int = 1) -> np.ndarray:
    """``[N]`` k-means cluster of every recorded step's state, within its task type.

    The state is the request's rule features (verb, urgency, target …) and the step's tool
    context (latest result's key fields, scalar state, progress flags), each block scaled
    to unit mean row norm.  The log's trace is left out on purpose: an environment's own
    trace differs from the log's, while the context is what it shares with the log.
    Rows of one task type get ``min(n_clusters, distinct states, rows // min_cluster_steps)``
    clusters (at least one)."""
    from sklearn.cluster import KMeans

    n = raw.n_steps
    out = np.zeros(n, dtype=np.int64)
    if n == 0:
        return out
    step_task = task_code[raw.step_episode]
    blocks = [raw.intent_rules[raw.step_episode].astype(np.float64), raw.context.astype(np.float64)]
    scaled = []
    for b in blocks:
        norm = float(np.linalg.norm(b, axis=1).mean())
        scaled.append(b / norm if norm > 0 else b)
    X = np.concatenate(scaled, axis=1)
    for code in np.unique(step_task):
        rows = np.flatnonzero(step_task == code)
        k = min(int(n_clusters), len(np.unique(X[rows], axis=0)), len(rows) // max(1, int(min_cluster_steps)))
        if k <= 1:
            continue
        km = KMeans(n_clusters=k, n_init=4, random_state=seed)
        out[rows] = km.fit_predict(X[rows])
    return out


def _assemble(episodes: Sequence[Episode], catalog: Catalog, raw: RawStateFeatures, result: Any,
              rules: MaskRules, config: SimConfig, device: str | torch.device) -> SimTables:
    """Tables from the pieces both builders compute (features, pyramid score, mask rules)."""
    frame, template = result.frame, result.template
    if list(raw.episode_ids) != [str(x) for x in frame.episode_ids.tolist()]:
        raise InputError("state features and reward scores list the episodes in a different order; "
                         "rebuild the state features of this dataset", field="dataset")
    n, n_eps = raw.n_steps, len(episodes)
    if n == 0:
        raise InputError("the dataset has no recorded steps to simulate", field="dataset")
    A = len(catalog.tokens)
    ep_len = frame.ep_len.astype(np.int64)
    ep_start = frame.ep_start.astype(np.int64)
    ep_end = ep_start + ep_len
    step_episode = raw.step_episode.astype(np.int64)
    step_t = raw.step_t.astype(np.int64)
    token = raw.action_token.astype(np.int64)
    step_last = (np.arange(n) + 1) == ep_end[step_episode]

    # Seconds from each step to the next logged step of its episode (0 after the last),
    # read back from the encoder's own trace (log1p of the seconds since the previous
    # step), so the environment's Δt means exactly what the log's does.
    step_dt = np.zeros(n, dtype=np.float64)
    step_dt[:-1] = np.expm1(raw.trace_dt[1:, 0].astype(np.float64))
    step_dt[step_last] = 0.0

    # Task types as codes (None is a type of its own).
    task_names: list[str | None] = list(dict.fromkeys(frame.task_type.tolist()))
    task_index = {t: i for i, t in enumerate(task_names)}
    task_code = np.array([task_index[t] for t in frame.task_type.tolist()], dtype=np.int64)
    cluster = state_clusters(raw, task_code, config.n_clusters, config.seed, config.min_cluster_steps)
    K = int(config.n_clusters)
    valid = token >= 0
    step_bucket = np.where(valid, (task_code[step_episode] * K + cluster) * A + np.maximum(token, 0), -1)
    n_buckets = len(task_names) * K * A
    # history keys pack the bucket and k trace tokens into one int64 (history_key)
    if n_buckets * (A + 3) ** int(config.history_match) >= 2 ** 63:
        raise InputError(f"history_match {config.history_match} is too long for {len(task_names)} task types × "
                         f"{K} clusters × {A} actions (the draw keys would overflow 64 bits); lower it",
                         field="history_match")
    order = np.argsort(np.where(valid, step_bucket, n_buckets), kind="stable")
    order = order[: int(valid.sum())]
    bucket_offsets = np.searchsorted(step_bucket[order], np.arange(n_buckets + 1)).astype(np.int64)

    resolved = np.asarray(frame.resolved, dtype=np.float64)
    final_reward = np.asarray(frame.final_reward, dtype=np.float64)
    success = np.where(~np.isnan(resolved), resolved,
                       np.where(~np.isnan(final_reward), (final_reward > 0).astype(np.float64), 0.0))
    terminal_token = np.zeros(A, dtype=bool)
    terminal_token[catalog.final_id] = True
    # Own-history penalties (duplicate_calls): column, weight × per, cap; the tool-call tokens.
    from core.rewards.template import build_component  # deferred: loads pandas and scipy

    history = [(c, spec.weight * float(spec.params_with_defaults()["per"]), int(spec.params_with_defaults()["cap"]))
               for c, spec in enumerate(template.step_components) if spec.component == "duplicate_calls"]
    call_token = np.array([tok.kind == "tool_call" for tok in catalog.tokens], dtype=bool)
    # Which earlier own actions count as a repeat of each token, per such component: a
    # class per token (its tool, when the component matches whole tools, else the token
    # itself), offset per component into one flat counter row of H·(tools + A) cells.
    tool_names = sorted({tok.tool for tok in catalog.tokens if tok.tool})
    tool_index = {t: i for i, t in enumerate(tool_names)}
    n_class = len(tool_names) + A
    history_class = np.zeros((len(history), A), dtype=np.int64)
    for h, (c, _, _) in enumerate(history):
        comp = build_component(template.step_components[c])
        whole = dict(zip(tool_names, comp.by_tool(tool_names)))
        history_class[h] = [h * n_class + (tool_index[tok.tool] if tok.tool and whole[tok.tool]
                                           else len(tool_names) + a)
                            for a, tok in enumerate(catalog.tokens)]
    finals = np.asarray(result.final, dtype=np.float64)
    finals = finals[np.isfinite(finals)]
    unanswered = (float(config.unanswered_outcome) if config.unanswered_outcome is not None
                  else float(finals.min()) if finals.size else 0.0)

    states = [(s.observation.get("state") if isinstance(s.observation, dict) else None) or {}
              for ep in episodes for s in ep.steps]
    columns = state_features([s if isinstance(s, dict) else {} for s in states],
                             [task_names[c] for c in task_code[step_episode]])

    dev = torch.device(device)
    t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=dev)  # noqa: E731
    tensors = {
        "step_episode": t(step_episode, torch.int64), "step_t": t(step_t, torch.int64),
        "token": t(token, torch.int64),
        "step_reward": t(result.step_reward, torch.float32), "step_reward64": t(result.step_reward, torch.float64),
        "components": t(result.contributions(), torch.float32), "step_dt": t(step_dt, torch.float32),
        "cluster": t(cluster, torch.int64), "step_bucket": t(step_bucket, torch.int64),
        "step_last": t(step_last, torch.bool), "context": t(raw.context, torch.float32),
        "ep_start": t(ep_start, torch.int64), "ep_len": t(ep_len, torch.int64), "ep_end": t(ep_end, torch.int64),
        "final": t(result.final, torch.float64), "success": t(success, torch.float32),
        "episode_return": t(result.returns, torch.float64), "task_code": t(task_code, torch.int64),
        "intent_emb": t(raw.intent_emb, torch.float32), "intent_rules": t(raw.intent_rules, torch.float32),
        "bucket_offsets": t(bucket_offsets, torch.int64), "bucket_steps": t(order, torch.int64),
        "terminal_token": t(terminal_token, torch.bool), "call_token": t(call_token, torch.bool),
        "history_cols": t(np.array([h[0] for h in history], dtype=np.int64), torch.int64),
        "history_coef": t(np.array([h[1] for h in history], dtype=np.float64), torch.float64),
        "history_cap": t(np.array([h[2] for h in history], dtype=np.int64), torch.int64),
        "history_class": t(history_class, torch.int64),
        "unanswered": t(np.array(unanswered, dtype=np.float64), torch.float64),
    }
    for k in range(1, int(config.history_match) + 1):
        keys, steps = _history_tables(step_bucket, raw.trace_action, k, A)
        tensors[f"history_keys_{k}"], tensors[f"history_steps_{k}"] = t(keys, torch.int64), t(steps, torch.int64)
    from core.rewards.outcomes import episode_groups  # deferred: loads pandas and scipy

    task_of = dict(zip((e.episode_id for e in episodes), episode_groups(episodes).tolist()))
    return SimTables(
        n_actions=A, n_components=len(template.step_components),
        component_names=[c.name for c in template.step_components], catalog=catalog, mask_rules=rules,
        compiled_masks=rules.compile(catalog), episode_ids=list(raw.episode_ids),
        behaviours=[None if b is None else str(b) for b in frame.behaviour.tolist()],
        task_types=[task_names[c] for c in task_code],
        task_ids=[task_of.get(str(e), str(e)) for e in raw.episode_ids], gamma=float(template.gamma), a=float(template.a),
        b=float(template.b), config=config, raw=raw, state_columns=columns, task_names=task_names,
        n_clusters=K, template_name=template.name, device=dev, tensors=tensors)


def build_sim_tables_from(episodes: Sequence[Episode], tools: Sequence[ToolSchema] | None, template: Any, *,
                          masks: MaskRules | str | Path | None = None, config: SimConfig | None = None,
                          embedder: Any = None, device: str | torch.device = "cpu",
                          catalog: Catalog | None = None) -> SimTables:
    """Simulator tables of in-memory episodes (tests, notebooks; no workspace).

    ``template``: a :class:`~core.rewards.Template`, a file or a shipped template name;
    ``masks``: :class:`MaskRules`, a YAML file, or None (no rules); ``embedder``: the
    sentence embedder (default: the offline model with an in-memory cache); ``catalog``:
    the action catalog to map the logged calls onto (e.g. a trained run's, so its policy's
    actions keep their meaning; ``tools`` is then unused and a call the catalog cannot
    express is INVALID); default the catalog of ``tools`` with presets learned from
    ``episodes``."""
    from core.rewards import Pyramid, ScoringContext, as_template, build_frame  # deferred: loads pandas and scipy

    episodes = list(episodes)
    if catalog is None:
        catalog = build_catalog(list(tools or []), episodes)
    embedder = embedder if embedder is not None else Embedder(cache_dir=None)
    raw = extract_features(episodes, catalog, embedder)
    frame = build_frame(episodes, catalog)
    result = Pyramid(as_template(template)).score(frame, ctx=ScoringContext(embedder=embedder))
    return _assemble(episodes, catalog, raw, result, _as_rules(masks), config or SimConfig(), device)


def build_sim_tables(ws: Any, dataset: str, template: Any, *, masks: MaskRules | str | Path | None = None,
                     config: SimConfig | None = None, device: str | torch.device = "cpu",
                     catalog: Catalog | None = None) -> SimTables:
    """Simulator tables of a workspace dataset.

    State features and reward components come from their workspace caches; the mask rules
    (``masks``: rules, a YAML file or None) are joined by the workspace's review rules
    (rejected reviews), so training never takes an action a reviewer rejected.

    ``catalog``: map the dataset's logged calls onto this catalog (e.g. a trained run's)
    instead of the dataset's own.  The dataset's review rules name tokens of its own
    catalog, so they are not joined then: ``masks`` is used as given (a run's rules already
    hold the review rules of its own dataset)."""
    from core.rewards import build_frame, score  # deferred: loads pandas and scipy
    from core.rewards.criteria import stamp_task_ids  # deferred: with the scoring imports above

    require_dataset(ws, dataset)
    own_catalog = catalog is None
    if catalog is None:
        catalog = catalog_for_dataset(ws, dataset)
    episodes = ws.load_episodes(dataset)
    raw = raw_features_for_dataset(ws, dataset, catalog)
    frame = build_frame(episodes, catalog)
    stamp_task_ids(frame, ws, dataset, episodes)   # the dataset's task criteria reach the criteria terms
    result = score(ws, template, frame=frame)
    rules = with_review_rules(_as_rules(masks), ws, dataset) if own_catalog else _as_rules(masks)
    return _assemble(episodes, catalog, raw, result, rules, config or SimConfig(), device)


# --------------------------------------------------------------------------- batched simulator
@dataclass
class SimStep:
    """What one batched step returns (all tensors on the simulator's device).

    ``obs``/``mask`` are those of the *next* state; for an environment that finished, of
    the first state of its new episode (auto-reset).  ``obs`` tensors are fresh, unless the
    simulator was made with ``reuse_obs_buffers=True``: then ``intent_emb``,
    ``intent_rules`` and ``context`` are its own buffers, rewritten in place by the next
    step (no large allocation per step; copy what you keep — a rollout buffer's
    ``obs_buf[t] = obs`` does).  ``info``:

    * ``off_support`` Bool[B], ``followed_log`` Bool[B], ``end_of_log`` Bool[B];
    * ``source_step`` Long[B] — recorded step whose result was used (-1 off-support);
    * ``step_reward`` Float[B] — pyramid-scale ``r`` (reward = ``a·r + b·final/γ^t``);
    * ``components`` Float[B, C] — weighted gated component values of that step;
    * ``final`` Float[B] — the R_final earned on this step (0 unless it ended with one);
    * ``episode_return`` Float[B] — ``a·Σγ^i r_i + b·R_final`` (NaN unless done);
    * ``episode_length`` Long[B] (0 unless done); ``success`` Float[B] (NaN unless done);
    * ``mask_violation`` Bool[B] — the action was outside the mask given with the state;
    * ``mask_fallback`` Bool[B] — the new state's rules blocked everything (F0/E0 kept);
    * ``start_episode`` Long[B] — episode index the finished/current episode started from;
    * ``state_step`` Long[B] — the recorded step whose state the action was taken in.

    It is a :class:`core.rl.env.EnvStep`: ``done`` is ``terminated | truncated``.
    """

    obs: dict[str, torch.Tensor]
    mask: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    info: dict[str, torch.Tensor]

    @property
    def done(self) -> torch.Tensor:
        """Bool[B]: the episode ended here (terminated or truncated)."""
        return self.terminated | self.truncated


def _merge_rules(base: MaskRules, extra: MaskRules | Sequence[Mapping[str, Any]] | str | Path | None) -> MaskRules:
    if extra is None:
        return base
    out = MaskRules(list(base.rules), description=base.description, source=base.source)
    if isinstance(extra, (MaskRules, str, Path)):
        extra = [r.to_dict() for r in _as_rules(extra).rules]
    out.add_rules(list(extra))
    return out


def support_table(tables: SimTables, episodes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Counterfactual CSR ``(offsets, steps)`` restricted to recorded steps of ``episodes``
    (all when None): an environment trained on some episodes draws outcomes only from them."""
    if episodes is None:
        return tables.bucket_offsets, tables.bucket_steps
    keep = _episode_keep(tables, episodes)
    steps = tables.bucket_steps
    steps = steps[keep[tables.step_episode[steps]]]           # order (by bucket) is kept
    n_buckets = tables.bucket_offsets.shape[0] - 1
    offsets = torch.searchsorted(tables.step_bucket[steps],
                                 torch.arange(n_buckets + 1, device=tables.device))
    return offsets, steps


def history_support(tables: SimTables, episodes: torch.Tensor | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The history-matched draw tables ``[(sorted keys, steps)]`` for k = 1, 2, …,
    restricted like :func:`support_table`."""
    out = []
    keep = None if episodes is None else _episode_keep(tables, episodes)
    for k in range(1, int(tables.config.history_match) + 1):
        keys, steps = tables.tensors[f"history_keys_{k}"], tables.tensors[f"history_steps_{k}"]
        if keep is not None:
            sel = keep[tables.step_episode[steps]]            # the key order is kept
            keys, steps = keys[sel], steps[sel]
        out.append((keys, steps))
    return out


def _episode_keep(tables: SimTables, episodes: torch.Tensor) -> torch.Tensor:
    keep = torch.zeros(tables.n_episodes, dtype=torch.bool, device=tables.device)
    keep[episodes.to(tables.device).long()] = True
    return keep


class BatchedSim:
    """B recorded-episode environments as tensors on one device (a :class:`core.rl.env.BatchedEnv`).

    ``reset``/``step`` are gathers over :class:`SimTables` and ``where``s over the batch — no
    Python loop per environment or step, and on an accelerator no host synchronisation but
    the check that the actions are tokens (so it runs on CUDA at the GPU's pace).
    ``episodes`` restricts the start episodes (a train / held-out split) and, unless
    ``support_episodes`` says otherwise (indices, or ``"all"``), the recorded steps that
    counterfactual outcomes are drawn from.  ``extra_mask_rules`` (rules or rule dicts)
    join the tables' rules.

    Randomness: each reset/step draws one ``[B, 2]`` tensor of integers from
    :attr:`generator` (column 0: the counterfactual pick, column 1: the next start episode).
    ``reuse_obs_buffers=True`` returns the request/context features in buffers that the
    next step overwrites (see :class:`SimStep`) — for loops that copy observations anyway."""

    def __init__(self, tables: SimTables, n_envs: int, *, device: str | torch.device = "cpu", seed: int = 0,
                 episodes: torch.Tensor | Sequence[int] | None = None,
                 extra_mask_rules: MaskRules | Sequence[Mapping[str, Any]] | None = None,
                 support_episodes: torch.Tensor | Sequence[int] | str | None = None,
                 reuse_obs_buffers: bool = False):
        if int(n_envs) < 1:
            raise InputError(f"n_envs must be at least 1, not {n_envs}", field="n_envs")
        self.device = torch.device(device)
        self.tables = tables.to(self.device)
        self.n_envs = B = int(n_envs)
        self.n_actions = tables.n_actions
        self.config = tables.config
        #: γ of the reward template: the discounted sum of a step's rewards is the template's return.
        self.gamma = float(tables.gamma)
        self.component_names = list(tables.component_names)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))

        tb = self.tables
        self.start_episodes = self._episode_index(episodes)
        if isinstance(support_episodes, str):
            if support_episodes != "all":
                raise InputError(f"support_episodes must be episode indices or 'all', not {support_episodes!r}",
                                 field="support_episodes")
            support = None
        elif support_episodes is None:
            support = None if episodes is None else self.start_episodes
        else:
            support = self._episode_index(support_episodes)
        self.bucket_offsets, self.bucket_steps = support_table(tb, support)
        self.history_tables = history_support(tb, support)
        #: Look up only the rows that need it (CPU) or every row, sync-free (accelerators).
        self.subset_rows = self.device.type == "cpu"

        rules = _merge_rules(tb.mask_rules, extra_mask_rules)
        self.compiled_masks = tb.compiled_masks if rules is tb.mask_rules else rules.compile(tb.catalog)
        self._mask_cols = tb.mask_inputs(self.compiled_masks)

        # Per-step lookups packed once, so a step gathers one row per environment and table:
        # at the state it stands on — (logged token, counterfactual bucket base); at the
        # recorded step it uses — (r, Δt, last step?, its episode's R_final and success).
        bucket_base = tb.bucket(tb.task_code[tb.step_episode], tb.cluster, torch.zeros_like(tb.cluster))
        self._at_state = torch.stack([tb.token, bucket_base], dim=1)
        self._at_used = torch.stack([tb.step_reward64, tb.step_dt.double(), tb.step_last.double(),
                                     tb.final[tb.step_episode], tb.success[tb.step_episode].double()], dim=1)
        self._gamma = float(tb.gamma)
        self._a, self._b = float(tb.a), float(tb.b)
        self._step_cap = int(self.config.step_cap)
        self._penalty = torch.tensor(float(self.config.off_support_penalty), dtype=torch.float64,
                                     device=self.device)
        self._unanswered = tb.unanswered.reshape(())
        self._history_cols, self._history_coef = tb.history_cols, tb.history_coef
        self._history_cap = tb.history_cap
        # [A, H] flat counter cell of each token per own-history component
        self._history_class = tb.history_class.t().contiguous()
        n_cells = int(tb.history_class.max()) + 1 if tb.history_class.numel() else 0

        dev = self.device
        # Environment state.
        self.pointer = torch.zeros(B, dtype=torch.int64, device=dev)        # recorded step the env stands on
        self.episode = torch.zeros(B, dtype=torch.int64, device=dev)        # start episode (intent, task type)
        self.t = torch.zeros(B, dtype=torch.int64, device=dev)              # steps taken in this episode
        # Still on the log of the start episode, every action so far the logged one?
        self.on_own_log = torch.ones(B, dtype=torch.bool, device=dev)
        # Own action counts (business limits read them); they never exceed the step cap,
        # so a byte per entry keeps the [B, A] table small.
        # (uint8 on the CPU, where bandwidth is short; int32 on accelerators, whose
        # index_add in the limit evaluation wants a type with native atomics.)
        small = self.device.type == "cpu" and int(self.config.step_cap) <= 255
        count_dtype = torch.uint8 if small else torch.int32
        self.counts = torch.zeros((B, self.n_actions), dtype=count_dtype, device=dev)
        # the same own actions counted per repeat class of the own-history components
        self.history_counts = torch.zeros((B, n_cells), dtype=count_dtype, device=dev)
        # The request's features change only when an episode starts: per-env buffers,
        # rewritten row-wise at a reset instead of gathered every step.
        self.intent_emb = torch.zeros((B, tb.intent_emb.shape[1]), dtype=torch.float32, device=dev)
        self.intent_rules = torch.zeros((B, tb.intent_rules.shape[1]), dtype=torch.float32, device=dev)
        self.trace_action = torch.full((B, TRACE_LEN), PAD_TOKEN, dtype=torch.int64, device=dev)
        self.trace_reward = torch.zeros((B, TRACE_LEN), dtype=torch.float32, device=dev)
        self.trace_elapsed = torch.zeros((B, TRACE_LEN), dtype=torch.float32, device=dev)
        self.discounted = torch.zeros(B, dtype=torch.float64, device=dev)   # Σ γ^i r_i so far
        self.discount = torch.ones(B, dtype=torch.float64, device=dev)      # γ^t
        self.mask = torch.ones((B, self.n_actions), dtype=torch.bool, device=dev)
        self._context = torch.zeros((B, tb.context.shape[1]), dtype=torch.float32, device=dev)
        self._arange = torch.arange(B, device=dev)
        self._started = False
        self.reuse_obs_buffers = bool(reuse_obs_buffers)

    # ------------------------------------------------------------------ helpers
    def _episode_index(self, episodes: torch.Tensor | Sequence[int] | None) -> torch.Tensor:
        E = self.tables.n_episodes
        if episodes is None:
            return torch.arange(E, device=self.device)
        idx = torch.as_tensor(episodes, dtype=torch.int64).reshape(-1).cpu()
        if idx.numel() == 0:
            raise InputError("no episodes to start from", field="episodes")
        if int(idx.min()) < 0 or int(idx.max()) >= E:
            raise InputError(f"episode indices must lie in 0..{E - 1}", field="episodes")
        return idx.to(self.device)

    def seed(self, seed: int) -> None:
        """Reseed the simulator's generator (the next draws repeat for the same seed)."""
        self.generator.manual_seed(int(seed))

    def _draw(self) -> torch.Tensor:
        return torch.randint(0, RANDOM_HIGH, (self.n_envs, 2), generator=self.generator, device=self.device)

    def _start(self, rows: torch.Tensor, draw: torch.Tensor, start: torch.Tensor | None) -> None:
        """Begin a new episode in the environments where ``rows`` is True."""
        tb = self.tables
        if start is None:
            start = self.start_episodes[draw % self.start_episodes.shape[0]]
        r1 = rows[:, None]
        self.episode = torch.where(rows, start, self.episode)
        self.pointer = torch.where(rows, tb.ep_start[start], self.pointer)
        self.t = torch.where(rows, 0, self.t)
        self.on_own_log = self.on_own_log | rows
        self.trace_action.masked_fill_(r1, PAD_TOKEN)
        self.trace_reward.masked_fill_(r1, 0.0)
        self.trace_elapsed.masked_fill_(r1, 0.0)
        self.discounted.masked_fill_(rows, 0.0)
        self.discount.masked_fill_(rows, 1.0)
        if self.device.type == "cpu":
            # Touch only the restarted rows (a host-side index is free on the CPU).
            idx = rows.nonzero().squeeze(1)
            ep = start.index_select(0, idx)
            self.counts.index_fill_(0, idx, 0)
            self.history_counts.index_fill_(0, idx, 0)
            self.intent_emb.index_copy_(0, idx, tb.intent_emb.index_select(0, ep))
            self.intent_rules.index_copy_(0, idx, tb.intent_rules.index_select(0, ep))
        else:
            # On an accelerator full-width writes avoid a host synchronisation.
            self.counts.masked_fill_(r1, 0)
            self.history_counts.masked_fill_(r1, 0)
            self.intent_emb = torch.where(r1, tb.intent_emb.index_select(0, start), self.intent_emb)
            self.intent_rules = torch.where(r1, tb.intent_rules.index_select(0, start), self.intent_rules)

    def _observe(self) -> dict[str, torch.Tensor]:
        tb = self.tables
        filled = self.trace_action != PAD_TOKEN
        if self.reuse_obs_buffers:
            intent_emb, intent_rules = self.intent_emb, self.intent_rules
            context = torch.index_select(tb.context, 0, self.pointer, out=self._context)
        else:
            intent_emb, intent_rules = self.intent_emb.clone(), self.intent_rules.clone()
            context = tb.context.index_select(0, self.pointer)
        return {
            "intent_emb": intent_emb,
            "intent_rules": intent_rules,
            "context": context,
            "trace_action": self.trace_action.clone(),
            "trace_reward": self.trace_reward.clone(),
            # the encoder's convention: log1p of the seconds since that step (0 when none)
            "trace_dt": torch.where(filled, torch.log1p(self.trace_elapsed.clamp_min(0.0)),
                                    torch.zeros_like(self.trace_elapsed)),
        }

    def _evaluate_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        feats = {name: col.index_select(0, self.pointer) for name, col in self._mask_cols.items()}
        res = self.compiled_masks.evaluate_torch(feats, self.counts, device=self.device, messages=False)
        # A [B, A] view of token-major storage: masked_fill/gather read it as is, and a
        # transposing copy would cost as much as the evaluation.
        return res.mask, res.fallback

    # ------------------------------------------------------------------ public API
    def observation_spec(self) -> dict[str, TensorSpec]:
        """Shape of one environment's row and dtype of each observation tensor (:data:`OBS_KEYS`)."""
        tb = self.tables
        return {
            "intent_emb": TensorSpec((int(tb.intent_emb.shape[1]),), torch.float32),
            "intent_rules": TensorSpec((int(tb.intent_rules.shape[1]),), torch.float32),
            "context": TensorSpec((int(tb.context.shape[1]),), tb.context.dtype),
            "trace_action": TensorSpec((TRACE_LEN,), torch.int64),
            "trace_reward": TensorSpec((TRACE_LEN,), torch.float32),
            "trace_dt": TensorSpec((TRACE_LEN,), torch.float32),
        }

    def action_masks(self) -> torch.Tensor:
        """Bool[B, A]: the actions allowed in each environment's current state."""
        return self.mask

    def reset(self, seed: int | None = None, start_episodes: torch.Tensor | Sequence[int] | None = None
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Start a new episode in every environment: ``(obs, mask)``.

        Start episodes are drawn uniformly from ``episodes`` (the constructor's), or given
        per environment by ``start_episodes`` (episode indices, length B)."""
        if seed is not None:
            self.seed(seed)
        draw = self._draw()
        start = None
        if start_episodes is not None:
            start = torch.as_tensor(start_episodes, dtype=torch.int64).reshape(-1).to(self.device)
            if start.shape[0] != self.n_envs:
                raise InputError(f"start_episodes needs {self.n_envs} entries, got {start.shape[0]}",
                                 field="start_episodes")
            if int(start.min()) < 0 or int(start.max()) >= self.tables.n_episodes:
                raise InputError(f"episode indices must lie in 0..{self.tables.n_episodes - 1}",
                                 field="start_episodes")
        self._start(torch.ones(self.n_envs, dtype=torch.bool, device=self.device), draw[:, 1], start)
        self.mask, _ = self._evaluate_mask()
        self._started = True
        return self._observe(), self.mask

    def _history_draw(self, drawn: torch.Tensor, bucket: torch.Tensor, draw: torch.Tensor,
                      counterfactual: torch.Tensor) -> torch.Tensor:
        """The counterfactual picks again, among the bucket's steps reached the way each
        environment came (its own last k actions; the longest match wins, none keeps
        ``drawn``).  On the CPU only the counterfactual rows are looked up (a host-side
        index is free there); on an accelerator every row, to avoid a synchronisation."""
        rows = counterfactual.nonzero().squeeze(1) if self.subset_rows else None
        if rows is not None:
            if not rows.numel():
                return drawn
            bucket, draw, trace = bucket.index_select(0, rows), draw.index_select(0, rows), \
                self.trace_action.index_select(0, rows)
            picked = drawn.index_select(0, rows)
        else:
            trace, picked = self.trace_action, drawn
        for k, (keys, steps) in enumerate(self.history_tables, start=1):
            if not keys.shape[0]:
                continue
            key = history_key(bucket, trace, k, self.n_actions)
            lo = torch.searchsorted(keys, key)
            n = torch.searchsorted(keys, key, right=True) - lo
            pick = (lo + draw % n.clamp_min(1)).clamp_max(keys.shape[0] - 1)
            picked = torch.where(n > 0, steps.index_select(0, pick), picked)
        return picked if rows is None else drawn.index_copy(0, rows, picked)

    def logged_actions(self) -> torch.Tensor:
        """Long[B]: the token logged at each environment's current recorded step (-1 = INVALID)."""
        return self.tables.token.index_select(0, self.pointer)

    def step(self, actions: torch.Tensor, *, auto_reset: bool = True) -> SimStep:
        """Take one action per environment (Long[B] token ids).

        ``-1`` replays a logged INVALID call where the log has one (so a logged episode can
        be replayed exactly, e.g. to evaluate a behaviour); it counts as following the log.

        With ``auto_reset`` (the default) finished environments start a new episode and
        ``obs``/``mask`` are its first; without it they stay on their last state (the
        Gymnasium wrapper resets them itself)."""
        if not self._started:
            raise InputError("call reset() before step()")
        tb, B = self.tables, self.n_envs
        actions = torch.as_tensor(actions, device=self.device).long().reshape(-1)
        if actions.shape[0] != B:
            raise InputError(f"step needs {B} actions, got {actions.shape[0]}", field="actions")
        ptr = self.pointer
        logged, bucket_base = self._at_state.index_select(0, ptr).unbind(1)
        # -1 (INVALID) replays a logged invalid call; anything else must be a catalog token.
        bad = (actions < -1) | (actions >= self.n_actions) | ((actions == -1) & (logged != -1))
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise InputError(f"action {int(actions[b])} of environment {b} is not a token of the "
                             f"catalog (0..{self.n_actions - 1}; -1 only replays a logged invalid call)",
                             field="actions")
        draw = self._draw()
        replay_invalid = actions < 0
        token = actions.clamp_min(0)           # for lookups; the replayed step never reads them
        mask_violation = ~self.mask.gather(1, token[:, None]).squeeze(1) & ~replay_invalid
        followed = actions == logged

        # Counterfactual: a uniform draw from the bucket (task type, state cluster, action).
        bucket = bucket_base + token
        lo = self.bucket_offsets.index_select(0, bucket)
        support = self.bucket_offsets.index_select(0, bucket + 1) - lo
        if self.bucket_steps.shape[0]:
            pick = (lo + draw[:, 0] % support.clamp_min(1)).clamp_max(self.bucket_steps.shape[0] - 1)
            drawn = self.bucket_steps.index_select(0, pick)
        else:
            drawn = ptr
        if self.history_tables:
            drawn = self._history_draw(drawn, bucket, draw[:, 0], ~followed & (support > 0))
        recorded = followed | (support > 0)
        off_support = ~recorded
        # followed: the own step; counterfactual: the drawn one; off-support: the own log's
        # step (its Δt and its end are what the environment lives through)
        used = torch.where(recorded & ~followed, drawn, ptr)
        r64, dt, last, final_of_used, success_of_used = self._at_used.index_select(0, used).unbind(1)
        r64 = torch.where(recorded, r64, self._penalty)
        comps = tb.components.index_select(0, used) * recorded[:, None]
        if self._history_cols.numel():
            # Own-history penalties: off the log, what this environment's own calls earn.
            cells = self._history_class.index_select(0, token)                    # [B, H]
            seen = self.history_counts.gather(1, cells).long()                     # earlier own repeats
            own = (-self._history_coef * torch.minimum(seen, self._history_cap).double()
                   * tb.call_token.index_select(0, token)[:, None])                 # [B, H]
            was = comps.index_select(1, self._history_cols).double()
            # the recorded value holds only while the environment is still on its own log
            # from the start: after any departure its history is its own, even where it
            # then follows another episode's log (whose earlier calls it never made)
            recompute = ~(followed & self.on_own_log) & ~replay_invalid
            adjust = torch.where(recompute[:, None], own - was, torch.zeros_like(own))
            r64 = r64 + adjust.sum(1)
            comps.index_add_(1, self._history_cols, adjust.float())

        # Where the environment goes next, and why it may stop.
        end_of_log = last > 0
        # the final-answer token ends the episode, unless it is the logged one mid-log (followed)
        final_action = tb.terminal_token.index_select(0, token) & ~replay_invalid & ~(followed & ~end_of_log)
        terminated = final_action | (end_of_log & recorded)
        t_next = self.t + 1
        truncated = ~terminated & ((t_next >= self._step_cap) | (end_of_log & off_support))
        done = terminated | truncated

        # Outcome: R_final of the recorded episode whose ending was used.
        ended_with_outcome = terminated & recorded
        # cut short (step cap, or off-support past the end of the own log): never answered
        final = torch.where(ended_with_outcome, final_of_used, torch.where(truncated, self._unanswered, 0.0))
        # R_final is not discounted in the template's return: on a terminal step at t it is
        # paid as b·R_final/γ^t, so that Σ γ^t·reward is exactly the template's return.
        reward = (self._a * r64 + self._b * final / self.discount).float()
        self.discounted = self.discounted + self.discount * r64
        nan = torch.full_like(reward, float("nan"))
        episode_return = torch.where(done, (self._a * self.discounted + self._b * final).float(), nan)
        success = torch.where(done, torch.where(ended_with_outcome, success_of_used, 0.0).float(), nan)
        r32 = r64.float()

        # The environment's own history: counts and the trace ring (newest first).
        # one cell per environment, so a gather/scatter pair needs no atomics
        cell = self._arange * self.n_actions + token
        flat = self.counts.view(-1)
        flat.scatter_(0, cell, flat.gather(0, cell) + (~replay_invalid).to(flat.dtype))
        if self._history_cols.numel():
            # distinct cells per row (one per component), so no atomics are needed either
            self.history_counts.scatter_add_(1, cells, (~replay_invalid)[:, None].to(self.history_counts.dtype)
                                             .expand_as(cells).contiguous())
        dt = dt.float()[:, None]
        self.trace_action = torch.cat([actions[:, None], self.trace_action[:, :-1]], dim=1)
        self.trace_reward = torch.cat([r32[:, None], self.trace_reward[:, :-1]], dim=1)
        self.trace_elapsed = torch.cat([torch.zeros_like(dt), self.trace_elapsed[:, :-1]], dim=1) + dt
        self.discount = self.discount * self._gamma
        start_episode = self.episode
        length = torch.where(done, t_next, 0)
        self.t = t_next
        self.on_own_log = self.on_own_log & followed
        # Past the end of a log there is no next state: the environment stays on its last
        # step (until it is reset); a truncated one shows the state it would have gone on from.
        self.pointer = torch.where(end_of_log, used, used + 1)
        if auto_reset:
            self._start(done, draw[:, 1], None)
        self.mask, fallback = self._evaluate_mask()

        info = {
            "off_support": off_support, "followed_log": followed, "end_of_log": end_of_log & recorded,
            "source_step": torch.where(recorded, used, torch.full_like(used, -1)),
            "step_reward": r32, "components": comps, "final": final.float(),
            "episode_return": episode_return, "episode_length": length, "success": success,
            "mask_violation": mask_violation, "mask_fallback": fallback, "start_episode": start_episode,
            "state_step": ptr,
        }
        return SimStep(self._observe(), self.mask, reward, terminated, truncated, info)


def random_masked_actions(mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Long[B]: one action per row, uniform among the allowed ones (the random-in-mask
    baseline).  Rejection sampling over the whole catalog, rows still rejected after a
    few rounds are settled exactly by a ranked draw — all batched."""
    B, A = mask.shape
    device = mask.device
    actions = torch.randint(0, A, (B,), generator=generator, device=device)
    ok = mask.gather(1, actions[:, None]).squeeze(1)
    for _ in range(3):
        retry = torch.randint(0, A, (B,), generator=generator, device=device)
        actions = torch.where(ok, actions, retry)
        ok = mask.gather(1, actions[:, None]).squeeze(1)
    rows = (~ok).nonzero().squeeze(1)
    if rows.numel():
        # The k-th allowed action, k uniform below the row's number of allowed actions.
        sub = mask.index_select(0, rows)
        k = torch.randint(0, RANDOM_HIGH, (rows.numel(),), generator=generator, device=device) \
            % sub.sum(dim=1).clamp_min(1)
        rank = sub.long().cumsum(dim=1) - 1
        exact = ((rank == k[:, None]) & sub).long().argmax(dim=1)
        actions = actions.index_copy(0, rows, exact)
    return actions


# --------------------------------------------------------------------------- splits and baselines
def split_episodes(tables: SimTables, heldout_fraction: float = 0.2, seed: int = 0, *,
                   by: str = "episode") -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, heldout)`` episode indices.

    ``by="episode"``: drawn within each (task type, behaviour) group so both halves see every
    kind of task and behaviour.  ``by="task"``: whole tasks (:attr:`SimTables.task_ids`) are
    held out until about ``heldout_fraction`` of the episodes are, so no task is on both
    sides — what an evaluation on real logs needs (many runs of one task look alike)."""
    if not 0.0 < float(heldout_fraction) < 1.0:
        raise InputError(f"heldout_fraction must lie strictly between 0 and 1, not {heldout_fraction}",
                         field="heldout_fraction")
    if by not in ("episode", "task"):
        raise InputError(f"heldout_by must be episode or task, not {by!r}", field="heldout_by")
    rng = np.random.default_rng(seed)
    heldout = np.zeros(tables.n_episodes, dtype=bool)
    if by == "task":
        tasks = np.array(tables.task_ids, dtype=object)
        names, sizes = np.unique(tasks, return_counts=True)
        target = float(heldout_fraction) * tables.n_episodes
        taken = 0
        for i in rng.permutation(names.size):
            if taken >= target:
                break
            heldout |= tasks == names[i]
            taken += int(sizes[i])
    else:
        groups: dict[tuple, list[int]] = {}
        for e, key in enumerate(zip(tables.task_types, tables.behaviours)):
            groups.setdefault(key, []).append(e)
        held: list[int] = []
        for key in sorted(groups, key=str):
            members = np.array(groups[key])
            k = int(round(float(heldout_fraction) * len(members)))
            held.extend(rng.permutation(members)[:k].tolist())
        if not held and tables.n_episodes > 1:
            # every group too small to hold one out (one run per task type, say): draw over all
            k = max(1, int(round(float(heldout_fraction) * tables.n_episodes)))
            held = rng.permutation(tables.n_episodes)[:k].tolist()
        heldout[held] = True
    if heldout.all() or not heldout.any():
        raise InputError(f"{tables.n_episodes} episodes are too few for a held-out fraction of "
                         f"{heldout_fraction}", field="heldout_fraction")
    as_t = lambda m: torch.as_tensor(np.flatnonzero(m), dtype=torch.int64, device=tables.device)  # noqa: E731
    return as_t(~heldout), as_t(heldout)


def logged_returns(tables: SimTables, episodes: torch.Tensor | Sequence[int] | None = None) -> dict[str, float]:
    """Mean template return of the logged episodes per behaviour (the baselines a trained
    policy is compared with); episodes without a behaviour label count as ``"unknown"``."""
    idx = (np.arange(tables.n_episodes) if episodes is None
           else torch.as_tensor(episodes, dtype=torch.int64).reshape(-1).cpu().numpy())
    returns = tables.episode_return.cpu().numpy()[idx]
    labels = [tables.behaviours[i] or "unknown" for i in idx]
    out: dict[str, float] = {}
    for b in sorted(set(labels)):
        sel = np.array([x == b for x in labels])
        out[b] = float(returns[sel].mean())
    return out


# --------------------------------------------------------------------------- flat observations
def obs_dim(tables: SimTables) -> int:
    """Width of :func:`flatten_obs`'s rows for these tables."""
    return (tables.intent_emb.shape[1] + tables.intent_rules.shape[1] + tables.context.shape[1]
            + TRACE_LEN * (tables.n_actions + 2) + 2 * TRACE_LEN)


def flatten_obs(obs: Mapping[str, torch.Tensor], n_actions: int) -> torch.Tensor:
    """``[B, D]`` float32: the raw feature vector of an observation batch — intent
    embedding, intent rules, context, one-hot trace tokens (PAD, INVALID, tokens…),
    trace rewards, trace Δt.  The Gymnasium wrapper's observation."""
    tokens = (obs["trace_action"].long() + 2).clamp(0, n_actions + 1)
    onehot = torch.zeros((*tokens.shape, n_actions + 2), dtype=torch.float32, device=tokens.device)
    onehot.scatter_(2, tokens[..., None], 1.0)
    return torch.cat([obs["intent_emb"].float(), obs["intent_rules"].float(), obs["context"].float(),
                      onehot.flatten(1), obs["trace_reward"].float(), obs["trace_dt"].float()], dim=1)


# --------------------------------------------------------------------------- Gymnasium wrapper
class RecordedEpisodeEnv(gymnasium.Env):
    """One recorded-episode environment with the Gymnasium API (Stable-Baselines3, RLlib).

    The same :class:`BatchedSim` with one environment: observations are the flat float32
    raw feature vector (:func:`flatten_obs`), actions the catalog's token ids,
    :meth:`action_masks` the mask of the current state (sb3-contrib's MaskablePPO reads
    it).  ``info`` carries the reward terms: the pyramid-scale ``step_reward``, every
    component's value under ``reward_terms``, ``final`` (R_final earned), and
    ``off_support`` / ``followed_log`` / ``mask_violation``; ``episode_return`` and
    ``success`` when the episode ends.  ``reset(options={"episode": i or id})`` starts a
    given recorded episode."""

    metadata = {"render_modes": []}

    def __init__(self, tables: SimTables, *, episodes: torch.Tensor | Sequence[int] | None = None,
                 device: str | torch.device = "cpu", seed: int = 0,
                 extra_mask_rules: MaskRules | Sequence[Mapping[str, Any]] | None = None,
                 support_episodes: torch.Tensor | Sequence[int] | str | None = None):
        super().__init__()
        self.sim = BatchedSim(tables, 1, device=device, seed=seed, episodes=episodes,
                              extra_mask_rules=extra_mask_rules, support_episodes=support_episodes)
        self.tables = self.sim.tables
        self.n_actions = tables.n_actions
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, shape=(obs_dim(tables),),
                                                      dtype=np.float32)
        self.action_space = gymnasium.spaces.Discrete(self.n_actions)
        self._mask = np.ones(self.n_actions, dtype=bool)
        self._done = True
        self._index = {eid: i for i, eid in enumerate(tables.episode_ids)}

    def _flat(self, obs: Mapping[str, torch.Tensor]) -> np.ndarray:
        return flatten_obs(obs, self.n_actions)[0].cpu().numpy()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        start = None
        if options and options.get("episode") is not None:
            ep = options["episode"]
            if isinstance(ep, str):
                if ep not in self._index:
                    raise InputError(f"no episode {ep!r} in the simulator's data", field="episode")
                ep = self._index[ep]
            start = [int(ep)]
        obs, mask = self.sim.reset(seed=seed, start_episodes=start)
        self._mask = mask[0].cpu().numpy().copy()
        self._done = False
        e = int(self.sim.episode[0])
        return self._flat(obs), {"episode_id": self.tables.episode_ids[e], "episode": e}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise InputError("the episode has ended: call reset() before step()")
        a = torch.tensor([int(action)], dtype=torch.int64, device=self.sim.device)
        out = self.sim.step(a, auto_reset=False)
        terminated, truncated = bool(out.terminated[0]), bool(out.truncated[0])
        self._done = terminated or truncated
        self._mask = out.mask[0].cpu().numpy().copy()
        i = out.info
        comps = i["components"][0].cpu().tolist()
        info: dict[str, Any] = {
            "step_reward": float(i["step_reward"][0]), "final": float(i["final"][0]),
            "reward_terms": dict(zip(self.tables.component_names, comps)),
            "off_support": bool(i["off_support"][0]), "followed_log": bool(i["followed_log"][0]),
            "mask_violation": bool(i["mask_violation"][0]), "source_step": int(i["source_step"][0]),
        }
        if self._done:
            info["episode_return"] = float(i["episode_return"][0])
            info["success"] = float(i["success"][0])
            info["episode_length"] = int(i["episode_length"][0])
        return self._flat(out.obs), float(out.reward[0]), terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        """Bool[A]: the actions allowed in the current state."""
        return self._mask.copy()


__all__ = ["BatchedSim", "OBS_KEYS", "RecordedEpisodeEnv", "SimConfig", "SimStep", "SimTables",
           "build_sim_tables", "build_sim_tables_from", "flatten_obs", "logged_returns", "obs_dim",
           "random_masked_actions", "split_episodes", "state_clusters", "support_table", "history_key",
           "history_support"]
