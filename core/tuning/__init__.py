"""Tuning pyramid weights with Optuna: objectives, constraints, studies, preference labels
and applying the best weights as a template version (:mod:`core.tuning.studies`), kept
in Optuna's own storage (:mod:`core.tuning.storage`).

May import: :mod:`core.rl` and everything below it; never :mod:`core.govern`.
"""
