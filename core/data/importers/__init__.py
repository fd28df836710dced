"""Importers of recorded agent episodes, one small class per format (see ``base.Importer``).

Formats, by registry name (``--format``; ``auto`` detects them from the content):

- ``openai`` — OpenAI chat-completions logs (``tool_calls`` + ``role: tool``);
- ``openai-legacy`` — ``function_call`` / ``role: function`` logs and ToolBench answer files;
- ``tau2`` — tau2-bench ``tasks.json`` gold actions, replayed from ``db.json``;
- ``bfcl`` — BFCL multi-turn questions with ``possible_answer`` ground truth;
- ``rwb`` — the workbench's own JSON Lines (what :func:`export_episodes` writes).

Public functions: :func:`import_file` (into a workspace, all or nothing),
:func:`read_file` (validate only), :func:`export_episodes`.
"""

from __future__ import annotations

# Importing the format modules registers them, in the order ``auto`` tries them.
from core.data.importers import openai as _openai  # noqa: F401  (openai, openai-legacy)
from core.data.importers import tau2 as _tau2  # noqa: F401
from core.data.importers import bfcl as _bfcl  # noqa: F401
from core.data.importers import rwb as _rwb  # noqa: F401
from core.data.importers.api import (
    ImportResult,
    detect_format,
    export_episodes,
    find_episode,
    import_file,
    read_file,
    single_dataset,
)
from core.data.importers.base import IMPORTERS, Importer, ParsedFile, ReadOptions, register

__all__ = ["IMPORTERS", "ImportResult", "Importer", "ParsedFile", "ReadOptions", "detect_format",
           "export_episodes", "find_episode", "import_file", "read_file", "register", "single_dataset"]
