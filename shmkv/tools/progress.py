"""Progress display for the long-running tools (``demo``, ``stress``, ``bench``).

Owns one small wrapper around ``rich.progress``: a bar on stderr with a spinner, the
work done, a line of free text and the elapsed time, refreshed from rich's own thread
so that a long step still shows the clock moving. It is shown only when stderr is a
terminal; otherwise (a pipe, a log file, CI) every call does nothing, so the output
stays what the tool prints itself. The library never uses this module.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:  # (imported where a bar is shown)
    from rich.progress import Progress, TaskID


def enabled() -> bool:
    """Whether a progress bar would be shown: stderr is a terminal (not a dumb one)."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class ProgressBar:
    """One task's progress bar; a no-op where :func:`enabled` is False or ``quiet``.

    Args:
        description: what is being done (shown before the bar).
        total: units of work in all (None: unknown, the bar pulses).
        unit: the unit of ``total``, shown after the count ("prompts", "s", "ops").
        quiet: never show anything.

    Use as a context manager, or call :meth:`close` when done (idempotent).
    """

    def __init__(
        self, description: str, total: Optional[float] = None, unit: str = "", quiet: bool = False
    ):
        self._progress: Optional[Progress] = None
        self._task: Optional[TaskID] = None
        if quiet or not enabled():
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:  # rich is a dependency; a broken install only loses the bar
            return
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} " + unit if total else unit),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, info="")

    def advance(self, amount: float = 1) -> None:
        """Count ``amount`` more units done."""
        if self._progress is not None:
            assert self._task is not None  # (added with the progress)
            self._progress.advance(self._task, amount)

    def update(
        self,
        completed: Optional[float] = None,
        description: Optional[str] = None,
        info: Optional[str] = None,
    ) -> None:
        """Set the units done, the description, or the free text after the bar."""
        if self._progress is None:
            return
        assert self._task is not None  # (added with the progress)
        fields: Dict[str, Any] = {}
        if completed is not None:
            fields["completed"] = completed
        if description is not None:
            fields["description"] = description
        if info is not None:
            fields["info"] = info
        self._progress.update(self._task, **fields)

    def close(self) -> None:
        """Stop refreshing; the last state stays on the terminal. Idempotent."""
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
