"""What a study tunes and on what: the template with the workspace version it came from
(:class:`TemplateRef`), the episodes and their steps frame with people's outcome labels over
the recorded outcomes (:func:`load_episodes_and_frame`),
the frame with the recorded outcome withheld from the components (:func:`withhold_outcomes`),
and the study's default name (:func:`default_study_name`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.base.errors import InputError
from core.data.importers import read_file
from core.records.catalog import catalog_for_dataset
from core.records.episodes import Episode
from core.rewards.api import frame_from_episodes
from core.rewards.frame import StepsFrame, build_frame
from core.rewards.labels import current_labels, labels_version
from core.rewards.template import Template, load_template, parse_template
from core.rewards.versions import get_template, parse_spec
from core.tuning.config import SearchSpace, TuneConfig
from core.tuning.labels import with_people_labels

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


@dataclass(frozen=True)
class TemplateRef:
    """The template a study tunes: its text, and the workspace version it came from."""

    template: Template
    name: str
    version: int | None
    yaml: str
    ref: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.yaml.encode("utf-8")).hexdigest()


def resolve_template_ref(ws: "Workspace | None", template: Template | str | Path) -> TemplateRef:
    """A ``--template`` argument (file, ``name``, ``name@N``, or a Template) with its version."""
    if isinstance(template, Template):
        return TemplateRef(template, template.name, None, template.to_yaml(), template.name)
    spec = str(template)
    path = Path(spec)
    if path.is_file() or spec.endswith((".yaml", ".yml")):
        if not path.is_file():
            raise InputError(f"no template file {spec!r}", field="template")
        text = path.read_text(encoding="utf-8")
        t = parse_template(text, file=str(path))
        return TemplateRef(t, t.name, None, text, spec)
    if ws is None:
        t = load_template(spec)
        return TemplateRef(t, t.name, None, t.to_yaml(), spec)
    name, version = parse_spec(spec)
    tv = get_template(ws, name, version)
    return TemplateRef(tv.template(), name, tv.version, tv.yaml, spec)


def withhold_outcomes(frame: StepsFrame) -> StepsFrame:
    """The frame with every outcome field unknown (components see no label); its own cache key."""
    nan = np.full(frame.n_episodes, np.nan)
    digest = hashlib.sha256(f"{frame.content_hash}|outcome-withheld".encode()).hexdigest()
    return replace(frame, resolved=nan, final_reward=nan.copy(), business_metric=nan.copy(),
                   sentiment=nan.copy(), content_hash=digest, _cache={})


def load_data(ws: "Workspace | None", *, dataset: str | None, episodes: str | Path | None) -> StepsFrame:
    """The steps frame of a workspace dataset or an episodes file."""
    return load_episodes_and_frame(ws, dataset=dataset, episodes=episodes)[1]


def load_episodes_and_frame(ws: "Workspace | None", *, dataset: str | None, episodes: str | Path | None
                            ) -> tuple[list[Episode], StepsFrame]:
    """The episodes of a workspace dataset or an episodes file, and their steps frame (the
    episodes carry what the frame does not: the imported record, where task ids live)."""
    if (dataset is None) == (episodes is None):
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file "
                         "(--episodes FILE)", field="dataset")
    if episodes is not None:
        if not Path(episodes).is_file():
            raise InputError(f"no episodes file {str(episodes)!r}", file=str(episodes))
        parsed = read_file(episodes)
        return parsed.episodes, frame_from_episodes(parsed.episodes, parsed.tools)
    if ws is None:
        raise InputError("tuning on a dataset needs a workspace", field="dataset")
    assert dataset is not None, "exactly one source is given, and it is not an episodes file"
    eps = ws.load_episodes(dataset)
    frame = build_frame(eps, catalog_for_dataset(ws, dataset))
    # people's outcome labels override the recorded outcomes (core.rewards.labels.dataset_outcomes)
    return eps, with_people_labels(frame, current_labels(ws, dataset), labels_version(ws, dataset))


def default_study_name(ref: TemplateRef, cfg: TuneConfig, data_name: str, space: SearchSpace) -> str:
    """``<template>-<objective>-<data>-<hash>``: the same template text, data, settings and
    space give the same name (so running again adds trials to the same study)."""
    body = json.dumps({"template": ref.sha256, "config": cfg.to_dict(), "space": space.to_dict(),
                       "data": data_name}, sort_keys=True, default=str)
    short = hashlib.sha256(body.encode()).hexdigest()[:8]
    return f"{ref.name}-{cfg.objective}-{data_name}-{short}"


def data_label(dataset: str | None, episodes: str | Path | None, labels: int = 0) -> str:
    """What a study's default name calls its data: the dataset (with the version of its people's
    labels, when it has some: new labels start a new study), or the episodes file's stem."""
    if dataset is None:
        return Path(str(episodes)).stem
    return f"{dataset}-labels{labels}" if labels else dataset
