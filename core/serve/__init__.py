"""Deciding in production: the decision engine with RL-Boost arbitration, metrics and
audit (:mod:`core.serve.serving`), its fast policy path (:mod:`core.serve.fast_policy`)
the HTTP decision service on FastAPI (:mod:`core.serve.serve_http`), the HTTP reward service
(:mod:`core.serve.reward_service`, ``rwb reward serve``) and what both check before a body is
read (:mod:`core.serve.http_guard`).

May import: :mod:`core.govern` and everything below it.
"""
