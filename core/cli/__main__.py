"""``python -m core.cli …``: the ``rwb`` command without the console script (background runs use it)."""

import sys

from core.cli import main

sys.exit(main())
