"""``python -m shmkv``: the same command line as ``shmkv``."""

import sys

from shmkv.tools.cli import main

sys.exit(main())
