"""Reward Workbench core library: the layers, bottom to top (docs/design.md §2.1).

``base`` → ``records`` → ``access`` → ``data`` | ``guard`` → ``rewards`` → ``state`` →
``rl`` → ``tuning`` | ``govern`` → ``serve`` → ``policies`` → ``sample`` → ``cli``.
A layer imports only the layers below it; ``a | b`` are independent of each other.  The
order is an import-linter contract in ``pyproject.toml``, checked by the test suite.
"""
