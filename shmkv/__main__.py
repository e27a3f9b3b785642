"""``python -m shmkv``: the same command line as ``shmkv``."""

import sys

from .tools.cli import main

sys.exit(main())
