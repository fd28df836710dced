"""The reward functions behind ``rwb reward …`` and the Reward Pyramid page.

Each UI/CLI action is one function here: :func:`validate`, :func:`score`,
:func:`reweight`, :func:`check`.  Data comes from a workspace dataset, from an
episodes file (any format the importers read), or from a steps frame the caller
already holds (the page keeps one per dataset so that edits re-use it).

Example::

    >>> ws = Workspace.open("workspace")                                    # doctest: +SKIP
    >>> result = score(ws, "finance_risk", dataset="finance")               # doctest: +SKIP
    >>> result.reweight({"tool_validity": 0.5}).episode_returns["fin-0001"] # doctest: +SKIP
    0.93
    >>> check(ws, "finance_risk", dataset="finance").passed                 # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.base import embed as text_embedding
from core.base.errors import InputError
from core.base.results import JSON_NAME
from core.data.importers import read_file
from core.records.catalog import build_catalog, catalog_for_dataset
from core.records.episodes import Episode, ToolSchema
from core.rewards.cache import ComponentCache
from core.rewards.components import ScoringContext
from core.rewards.criteria import episodes_criteria, frame_criteria, stamp_task_ids
from core.rewards.expectations import CheckReport, evaluate_expectations
from core.rewards.frame import StepsFrame, build_frame
from core.rewards.pyramid import Pyramid, ReturnFormula, ScoreResult
from core.rewards.template import Template, load_template
from core.rewards.trajectory import each_episode_frame
from core.rewards.versions import resolve_template

TemplateLike = Template | str | Path


def as_template(template: TemplateLike, ws=None) -> Template:
    """A :class:`Template` from a template, a file path or a shipped template name; with a
    workspace also ``name@N`` (a saved version) and a bare name resolving to its latest saved
    version before the shipped file (see :func:`core.rewards.versions.resolve_template`)."""
    if isinstance(template, Template):
        return template
    if ws is None:
        return load_template(template)
    return resolve_template(ws, str(template))


def frame_from_episodes(episodes: Sequence[Episode], tools: Sequence[ToolSchema] | None = None
                        ) -> StepsFrame:
    """Steps frame of in-memory episodes; the catalog comes from ``tools`` (or, without
    schemas, from the logged calls)."""
    return build_frame(episodes, build_catalog(list(tools or []), episodes))


def frame_from_file(path: str | Path) -> StepsFrame:
    """Steps frame of an episodes file in any importable format (nothing is stored)."""
    parsed = read_file(path)
    return frame_from_episodes(parsed.episodes, parsed.tools)


def load_frame(ws, dataset: str) -> StepsFrame:
    """Steps frame of a workspace dataset, normalised with the dataset's catalog; it notes
    its episodes' task ids, so that :func:`score` gives the criteria components the
    dataset's task criteria (docs/criteria.md)."""
    catalog = catalog_for_dataset(ws, dataset)
    episodes = ws.load_episodes(dataset)
    frame = build_frame(episodes, catalog)
    stamp_task_ids(frame, ws, dataset, episodes)   # so that score() joins the dataset's task criteria
    return frame


def _frame(ws, dataset: str | None, episodes: str | Path | None,
           frame: StepsFrame | None) -> StepsFrame:
    given = [x is not None for x in (dataset, episodes, frame)]
    if sum(given) != 1:
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file "
                         "(--episodes FILE)")
    if frame is not None:
        return frame
    if episodes is not None:
        return frame_from_file(episodes)
    if ws is None:
        raise InputError("scoring a dataset needs a workspace")
    assert dataset is not None, "exactly one source is given, and it is neither of the others"
    return load_frame(ws, dataset)


@dataclass(frozen=True)
class LevelDescription:
    """One level of a validated template."""

    key: str
    title: str
    #: The level's gate (None: no gate)
    gate: float | None
    #: Component name → weight, in the template's order
    components: dict[str, float]


@dataclass(frozen=True)
class ValidationReport:
    """What :func:`validate` says of a valid template: its levels, components, weights and
    expectations (an invalid one raises instead)."""

    #: Always True: a template that does not validate raises
    ok: bool
    name: str
    #: The template format version
    version: int
    #: Where it was read from (None: built in memory)
    source: str | None
    #: Whether a level counts only where the levels below it pass their gates
    gating: bool
    #: The return's coefficients, written as ``"return"`` in JSON (a keyword is no field name)
    return_: ReturnFormula = field(metadata={JSON_NAME: "return"})
    levels: list[LevelDescription]
    #: Penalty name → weight
    penalties: dict[str, float]
    #: Episode term name → weight
    episode_terms: dict[str, float]
    #: Names of the weight schedules, sorted
    schedules: list[str]
    #: Names of the expectations, in the template's order
    expectations: list[str]


def validate(template: TemplateLike, ws=None) -> ValidationReport:
    """Validate a template (raises :class:`~core.rewards.template.TemplateError` naming the key
    and line) and describe it: levels, components, weights, expectations.  With a workspace,
    saved versions resolve too (``finance_risk@3``)."""
    t = as_template(template, ws)
    return ValidationReport(
        ok=True, name=t.name, version=t.version, source=t.source, gating=t.gating,
        return_=ReturnFormula(a=t.a, b=t.b, gamma=t.gamma),
        levels=[LevelDescription(key=lv.key, title=lv.title, gate=lv.gate,
                                 components={c.name: c.weight for c in lv.components}) for lv in t.levels],
        penalties={c.name: c.weight for c in t.penalties},
        episode_terms={c.name: c.weight for c in t.episode_terms},
        schedules=sorted(t.schedules),
        expectations=[e.name for e in t.expectations],
    )


def each_frame(ws, dataset: str | None, episodes: str | Path | None) -> tuple[StepsFrame, Any]:
    """(frame, criteria) for scoring each episode on its own: every episode's calls normalised
    by its own catalog (the dataset's or file's tools, presets from its own calls), as the
    exported reward scores a trajectory (:mod:`core.rewards.trajectory`)."""
    if (dataset is None) == (episodes is None):
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file "
                         "(--episodes FILE)")
    if episodes is not None:
        parsed = read_file(episodes)
        return each_episode_frame(parsed.episodes, [parsed.tools] * len(parsed.episodes)), None
    if ws is None:
        raise InputError("scoring a dataset needs a workspace")
    assert dataset is not None, "exactly one source is given"
    if not ws.has_dataset(dataset):
        known = ", ".join(d.name for d in ws.datasets()) or "none yet"
        raise InputError(f"no dataset named {dataset!r} in the workspace; known: {known}", field="dataset")
    loaded = ws.load_episodes(dataset)
    tools = ws.tools(dataset)
    return each_episode_frame(loaded, [tools] * len(loaded)), episodes_criteria(ws, dataset, loaded)


def score(ws, template: TemplateLike, *, dataset: str | None = None,
          episodes: str | Path | None = None, frame: StepsFrame | None = None,
          use_cache: bool = True, progress: Callable[[dict[str, Any]], None] | None = None,
          each: bool = False) -> ScoreResult:
    """Score a dataset, an episodes file or a frame with a template.

    With a workspace, component columns are cached under ``artifacts/reward_matrix`` and
    text embeddings under ``artifacts/embeddings``: scoring the same data again with other
    weights, or with one component's parameters changed, recomputes only what changed.
    ``progress`` receives ``{"stage": "components" | "embedding", "done", "total", "what"}``
    as the work goes (see :meth:`ScoringContext.report`).

    ``each``: score every episode on its own — its own catalog and history, never the other
    episodes' — which is what the exported reward gives a trajectory (docs/export.md)."""
    t = as_template(template, ws)
    if each:
        if frame is not None:
            raise InputError("scoring each episode on its own reads a dataset or an episodes file")
        data, criteria = each_frame(ws, dataset, episodes)
        embedder = text_embedding.workspace_embedder(ws) if ws is not None else None
        return Pyramid(t).score(data, ctx=ScoringContext(embedder=embedder, progress=progress, criteria=criteria,
                                                         each_episode=True))
    data = _frame(ws, dataset, episodes, frame)
    if ws is not None:
        ctx = ScoringContext(embedder=text_embedding.workspace_embedder(ws), progress=progress,
                             criteria=frame_criteria(ws, data))
    else:
        ctx = ScoringContext(progress=progress)
    digest = ctx.criteria.digest if ctx.criteria is not None else ""
    cache = ComponentCache.for_workspace(ws, digest) if (ws is not None and use_cache) else None
    return Pyramid(t).score(data, ctx=ctx, cache=cache)


def reweight(result: ScoreResult, weights: Mapping[str, float]) -> ScoreResult:
    """New weights on an existing score: a matrix product, no component is recomputed."""
    return result.reweight(weights)


def check(ws, template: TemplateLike, *, dataset: str | None = None,
          episodes: str | Path | None = None, frame: StepsFrame | None = None,
          result: ScoreResult | None = None) -> CheckReport:
    """Score (unless ``result`` is given) and evaluate the template's expectations."""
    if result is None:
        result = score(ws, template, dataset=dataset, episodes=episodes, frame=frame)
    elif not isinstance(template, Template) or template != result.template:
        result = result.with_template(as_template(template, ws))
    return evaluate_expectations(result)
