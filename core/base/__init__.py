"""Foundations that know nothing of episodes, rewards or policies: the error types every
layer raises (:mod:`core.base.errors`), bounded YAML reading (:mod:`core.base.safe_yaml`),
the bundled templates and sample data (:mod:`core.base.package_data`) and the sentence
embedder with its hash-keyed cache (:mod:`core.base.embed`).

May import: nothing else in ``core``.
"""
