"""From a trained run to an approved policy: signed bundles (:mod:`core.govern.bundle`), the
registry with its promotion gate and four-eyes approval (:mod:`core.govern.registry`,
its own records in :mod:`core.govern.registry_records`) and the layout of the promoted
policies folder (:mod:`core.govern.policy_folder`).

May import: :mod:`core.rl` and everything below it; never :mod:`core.tuning`.
"""
