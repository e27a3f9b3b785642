"""Suites whose code still lives in ``scripts/`` of a checkout, run from here.

``metrics`` (``scripts/bench_metrics.py``) and ``vllm`` (``scripts/bench_vllm.py``) are
registered as suites of ``shmkv bench`` but not yet moved into this package: their
modules are loaded from the checkout's ``scripts/`` directory under their own names
(``bench_metrics``, ``bench_vllm``), that directory put on ``sys.path`` so that their
``spawn`` children import the same module, and their ``main()`` called with
``sys.argv`` set to the suite's arguments (both parse ``sys.argv``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import List, Optional

SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts")


class ScriptMissing(RuntimeError):
    """The suite's script is not there (an installed package has no ``scripts/``)."""


def script_path(module: str) -> str:
    """``scripts/MODULE.py`` of the checkout this package sits in."""
    return os.path.join(SCRIPTS_DIR, f"{module}.py")


def run_script(module: str, argv: List[str]) -> int:
    """Import ``scripts/MODULE.py`` as ``MODULE`` and run its ``main()`` with ``argv``."""
    path = script_path(module)
    if not os.path.exists(path):
        raise ScriptMissing(f"{path} is not there: this suite runs from a checkout of shmkv")
    if SCRIPTS_DIR not in sys.path:
        sys.path.insert(0, SCRIPTS_DIR)
    mod = importlib.import_module(module)
    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        rc: Optional[int] = mod.main()
    except SystemExit as exc:   # argparse errors and sys.exit() inside main()
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return rc or 0
