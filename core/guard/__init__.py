"""What an agent may do and who checks it: action masks and risk rules over the tool
catalog (:mod:`core.guard.masking`) and the human review queue of high-risk actions
(:mod:`core.guard.review`).

May import: :mod:`core.access`, :mod:`core.records`, :mod:`core.base`; never
:mod:`core.data` (the two are independent).
"""
