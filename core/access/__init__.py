"""Who may do what, and the record of what they did: users, roles and sessions
(:mod:`core.access.users`; every write in ``core`` calls ``authorize``), the append-only
audit trail (:mod:`core.access.audit`) and the workspace's signing keys
(:mod:`core.access.keys`).

May import: :mod:`core.records`, :mod:`core.base`.
"""
