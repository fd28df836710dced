"""Deciding in production: the decision engine with RL-Boost arbitration, metrics and
audit (:mod:`core.serve.serving`), its fast policy path (:mod:`core.serve.fast_policy`)
and the HTTP service on FastAPI (:mod:`core.serve.serve_http`).

May import: :mod:`core.govern` and everything below it.
"""
