"""shmkv's log lines in vLLM's own log, in the processes of a vLLM engine.

vLLM gives its ``vllm`` logger a handler of its own (stdout by default, its format, level
``VLLM_LOGGING_LEVEL``) and stops its records there (``propagate=False``); nothing
configures the root logger. shmkv's ``shmkv`` logger has only a ``NullHandler``, as a
library's should. So in ``vllm serve``'s engine-core and worker processes, where no
program of the user's runs, every "shmkv: ..." line of the connector went nowhere: a
coordinator that could not be reached, a pool that did not fit, a failed load.

:func:`log_through_vllm` gives the ``shmkv`` logger vLLM's handlers and level, unless the
process has configured logging for ``shmkv`` (or the root logger) itself: a program that
runs ``vllm.LLM`` with handlers of its own keeps them, and no line is written twice. It
does not change vLLM's loggers, the root logger, or a ``shmkv`` level already set.
"""

from __future__ import annotations

import logging
from typing import Optional


def log_through_vllm() -> bool:
    """Send the ``shmkv`` loggers' records to vLLM's log handlers, at vLLM's level.

    Does nothing (and returns False) when a handler other than a ``NullHandler`` is on
    ``shmkv``'s way to the root logger already, or when vLLM's logger has no handler
    (``VLLM_CONFIGURE_LOGGING=0``). Idempotent: a second call in a process changes
    nothing. Returns True when shmkv's records go to vLLM's handlers after the call.
    """
    shmkv_log = logging.getLogger("shmkv")
    vllm_log = logging.getLogger("vllm")
    handlers = list(vllm_log.handlers)
    if not handlers:
        return False
    if all(h in shmkv_log.handlers for h in handlers):
        return True
    logger: Optional[logging.Logger] = shmkv_log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return False  # configured by the program: its own choice
        logger = logger.parent if logger.propagate else None
    for handler in handlers:
        shmkv_log.addHandler(handler)
    if shmkv_log.level == logging.NOTSET:
        shmkv_log.setLevel(vllm_log.getEffectiveLevel())
    # vLLM's handlers see shmkv's records here; the root logger's (none in vLLM's
    # processes) would see them a second time.
    shmkv_log.propagate = False
    return True
