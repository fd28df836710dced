"""Synthetic recorded episodes for the built-in domains (the engine behind ``core.data.datasets``).

``common`` holds the counter-based random numbers, the argument checker and
the canonical episode/step records; ``finance`` and ``ecommerce`` each hold a
small world simulator plus the behaviour policies that act in it.  Use
:func:`core.data.datasets.generate` rather than these modules directly.
"""
