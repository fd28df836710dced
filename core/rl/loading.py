"""What a training run reads from the workspace: the simulator tables of a dataset (or an
episodes file) under a reward template and mask rules, the train / held-out split, the
logged baselines and the reviewer-approved examples (:func:`load_training_data`), and the
committed mask rules of a domain (:func:`domain_masks`, :func:`masks_for_domain`).

Example::

    >>> data = load_training_data(ws, "finance_risk", dataset="finance", config=PPOConfig())  # doctest: +SKIP
    >>> data.tables.n_episodes, data.best_behaviour                                        # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.base import embed as text_embedding
from core.base.errors import InputError
from core.rl.ppo import PPOConfig, TrainingData
from core.data.datasets import datasets_dir
from core.data.importers import read_file
from core.guard.masking import MaskRules
from core.guard.review import approved_examples, with_review_rules
from core.rl.sim import build_sim_tables, build_sim_tables_from, logged_returns, split_episodes

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


def masks_for_domain(domain: str | None) -> Path | None:
    """The committed mask rules of a domain (``datasets/<domain>/masks.yaml``), if any."""
    if not domain:
        return None
    path = datasets_dir() / str(domain) / "masks.yaml"
    return path if path.is_file() else None


def domain_masks(ws: "Workspace", dataset: str) -> Path | None:
    """The committed mask rules of a dataset's domain (``datasets/<domain>/masks.yaml``), if any."""
    row = ws.conn.execute("SELECT domain FROM datasets WHERE name=?", (dataset,)).fetchone()
    return masks_for_domain(row[0] if row else None)


#: ``masks=DOMAIN_MASKS``: the committed rules of the data's domain (the default).
DOMAIN_MASKS = "domain"


def load_training_data(ws: "Workspace", template: Any, *, dataset: str | None = None,
                       episodes_file: str | Path | None = None, masks: Any = DOMAIN_MASKS,
                       config: PPOConfig | None = None) -> TrainingData:
    """Simulator tables of a dataset (or episodes file) under ``template`` and ``masks``
    (rules, a YAML file or text, None for no rules, or by default the committed rules of the
    data's domain, ``datasets/<domain>/masks.yaml``), always joined by the workspace's review
    rules; the train / held-out split; logged returns; approved review examples."""
    cfg = config or PPOConfig()
    if (dataset is None) == (episodes_file is None):
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file (--episodes FILE)")
    parsed = None
    if episodes_file is not None:
        parsed = read_file(episodes_file)
        if not parsed.episodes:
            raise InputError("the episodes file holds no episodes", file=str(episodes_file))
    if isinstance(masks, str) and masks == DOMAIN_MASKS:
        masks = (domain_masks(ws, dataset) if dataset is not None
                 else masks_for_domain(parsed.episodes[0].domain))  # type: ignore[union-attr]
    rules = masks if isinstance(masks, MaskRules) or masks is None else MaskRules.from_yaml(masks)
    if dataset is not None:
        tables = build_sim_tables(ws, dataset, template, masks=rules, config=cfg.sim_config())
        source = f"dataset {dataset}"
    elif parsed is not None:
        rules = with_review_rules(rules or MaskRules(), ws, None)
        tables = build_sim_tables_from(parsed.episodes, parsed.tools, template, masks=rules,
                                       config=cfg.sim_config(), embedder=text_embedding.workspace_embedder(ws))
        source = f"file {episodes_file}"
    train_idx, held_idx = split_episodes(tables, cfg.heldout_fraction, cfg.seed, by=cfg.heldout_by)
    return TrainingData(tables=tables, train_episodes=train_idx, heldout_episodes=held_idx,
                        logged_returns=logged_returns(tables, train_idx),
                        approved=approved_examples(ws, dataset), dataset=dataset, source=source)



__all__ = ["DOMAIN_MASKS", "domain_masks", "load_training_data", "masks_for_domain"]
