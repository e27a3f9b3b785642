#!/usr/bin/env python3
"""Run ``shmkv stress`` (see ``shmkv/stress.py``); takes the same options."""

import sys

from shmkv.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["stress", *sys.argv[1:]]))
