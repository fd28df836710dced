"""The embedded default workspace: its sample data and review items
(:mod:`core.sample.workspace_setup`), preparing its caches before the app serves
(:mod:`core.sample.warmup`) and the end-to-end demo (:mod:`core.sample.demo`).

May import: every layer below the command line.
"""
