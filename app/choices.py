"""Dataset and template pickers whose defaults follow the user.

Every page that picks a dataset or a reward template draws it with :func:`dataset_select` and
:func:`template_select`: the picker opens on what this user chose last (on any page), else on
the newest dataset and on the newest template made for the dataset's domain
(:mod:`core.access.choices` decides); a dataset too small for the page is never the default.
The default is set once through the widget's session state, so a choice the user makes is
never overridden on a rerun; a choice is remembered only when the user changes the picker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import streamlit as st

from rwb_app import resources
from core.access.choices import dataset_domain, pick_dataset, pick_template, remember_choice

#: Session-state suffix under which a template picker keeps the dataset its default was for.
_FOR_DATASET = "__for_dataset"


def _remember(key: str, kind: str, page: str | None, dataset: str | None = None) -> None:
    """A picker's on_change: store the user's new choice (a template per dataset domain)."""
    value = st.session_state.get(key)
    if not value:
        return
    ws = resources.workspace()
    scope = dataset_domain(ws, dataset) if kind == "template" else None
    try:
        remember_choice(ws, resources.acting_user(), kind, str(value), scope=scope, page=page)
    except resources.USER_ERRORS as exc:  # a preference never stops the page
        st.toast(f"Your choice could not be remembered: {exc}")


def dataset_select(label: str, options: Sequence[str], *, key: str, page: str, min_episodes: int = 1,
                   container: Any = None, format_func: Callable[[str], str] | None = None,
                   **selectbox_kwargs: Any) -> str | None:
    """A dataset picker (``st.selectbox`` keyed ``key``) opening on the dataset this user used
    last, else the newest; one with fewer than ``min_episodes`` episodes is never the default
    and says so beside its name.  ``page`` names the page (kept with the choice);
    ``container`` is where to draw it (a column; default the page)."""
    where = container if container is not None else st
    options = list(options)
    ws = resources.workspace()
    pick = pick_dataset(ws, resources.acting_user(), options, min_episodes=min_episodes)
    if options and st.session_state.get(key) not in options:
        st.session_state[key] = pick.default
    shown = format_func or str
    too_small = set(pick.too_small)

    def label_of(name: str) -> str:
        if name in too_small:
            n = pick.episodes.get(name, 0)
            return f"{shown(name)} (only {n} episode{'s' if n != 1 else ''}: this page needs {min_episodes})"
        return shown(name)

    selectbox_kwargs.setdefault("help", f"Opens on {pick.reason}; your choice is remembered for every page.")
    return where.selectbox(label, options, key=key, format_func=label_of, on_change=_remember,
                           args=(key, "dataset", page), **selectbox_kwargs)


def template_select(label: str, options: Sequence[str], *, key: str, dataset: str | None,
                    container: Any = None, **selectbox_kwargs: Any) -> str | None:
    """A reward template picker (``options``: ``name@N`` specs) opening on the template this
    user used last on ``dataset``'s domain, else the newest one made for that domain
    (``tool_agent`` for logs of no known domain).  When the dataset changes, the picker moves
    to the default for the new one; otherwise the user's choice stays."""
    where = container if container is not None else st
    options = list(options)
    ws = resources.workspace()
    pick = pick_template(ws, resources.acting_user(), options, dataset=dataset)
    for_dataset = key + _FOR_DATASET
    dataset_changed = for_dataset in st.session_state and st.session_state[for_dataset] != dataset
    if options and (dataset_changed or st.session_state.get(key) not in options):
        st.session_state[key] = pick.default
    st.session_state[for_dataset] = dataset
    selectbox_kwargs.setdefault("help", f"Opens on {pick.reason}; @0 is the template shipped with "
                                        "the workbench, every save here is a new version.")
    return where.selectbox(label, options, key=key, on_change=_remember,
                           args=(key, "template", None, dataset), **selectbox_kwargs)
