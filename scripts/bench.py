#!/usr/bin/env python3
"""Run the shmkv benchmark suite: the same as ``shmkv bench`` (see ``--help``).

Usage from the repository root::

    python scripts/bench.py [--quick] [--name NAME] [--only SECTION ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shmkv.tools.cli import main  # noqa: E402  (after the path is set)

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
