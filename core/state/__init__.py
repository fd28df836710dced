"""The state an agent acts in, as numbers: the feature encoder shared by training,
evaluation and serving (:mod:`core.state.features`) and the t-SNE state map with its
fidelity checks (:mod:`core.state.statemap`).

May import: :mod:`core.rewards` and everything below it.
"""
