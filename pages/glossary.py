"""Glossary: the technical terms the app shows, in plain words, searchable."""

from __future__ import annotations

import streamlit as st

from rwb_app.glossary import TERMS, find_terms

st.title("Glossary")
st.caption("The technical terms the workbench shows, each with a plain name, what it means and what a good "
           "value looks like. Pages use the plain names; hover a figure's sign to see its technical term.")

query = st.text_input("Search the glossary", key="glossary_query", placeholder="e.g. entropy, held-out, AUC")
found = find_terms(query)
if not found:
    st.info(f"No term matches “{query}”. Try a shorter word.")
st.caption(f"{len(found)} of {len(TERMS)} terms.")
for name, entry in found:
    with st.container(border=True):
        st.markdown(f"**{name}** — {entry.label}")
        st.write(entry.meaning)
        if entry.good:
            st.caption(f"What good looks like: {entry.good}")
