"""Plotly figures of core's typed results, one module per topic; the pages draw them.

``core`` returns data (frames and dataclasses of arrays) and never imports plotly; the
figures are built here, in the app, which is what installs plotly (the ``app`` extra).
"""
