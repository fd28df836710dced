"""Getting episodes in: the importers for each log format (:mod:`core.data.importers`),
the sample datasets and their generators (:mod:`core.data.datasets`,
:mod:`core.data.datagen`) and the episode browsing the pages show
(:mod:`core.data.episode_views`), and the tasks' success criteria joined to episodes by task
id (:mod:`core.data.task_criteria`).

May import: :mod:`core.access`, :mod:`core.records`, :mod:`core.base`; never
:mod:`core.guard` (the two are independent).
"""
