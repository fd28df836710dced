"""The workspace and what it records: the SQLite workspace (:mod:`core.records.store`),
the episode model every importer produces (:mod:`core.records.episodes`) and the tool
catalog learned from a dataset (:mod:`core.records.catalog`).

May import: :mod:`core.base`.
"""
