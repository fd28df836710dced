"""The app as ``rwb app`` serves it: Streamlit's server (``st.App``, its documented ASGI
entry point) running ``main.py``, with the session-cookie route of
:mod:`rwb_app.session_cookie` added.  ``streamlit run`` finds ``app`` below and serves it;
``streamlit run app/main.py`` still works, with sign-ins that last only as long as a tab."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from rwb_app.preload import lifespan
from rwb_app.session_cookie import routes

# lifespan: the pages' modules are imported before the server accepts a connection.
app = st.App(Path(__file__).with_name("main.py"), routes=routes(), lifespan=lifespan)
