"""A coordinator serving from its own process, tied to the lifetime of its parent.

Owns starting the process (``spawn`` context), waiting for it to be ready with a
timeout, stopping it, and making sure it never outlives the process that started
it: the child watches a pipe to its parent and stops when the pipe closes, which
happens however the parent dies.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Optional

from .errors import CoordinatorTimeout, ShmkvError
from .layout import PoolConfig


def _child_main(config_wire: dict, name, address, options: dict, pipe) -> None:
    from .coordinator import Coordinator
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    try:
        coord = Coordinator(PoolConfig.from_wire(config_wire), name=name, address=address,
                            **options)
        coord.open()
    except BaseException as exc:  # report any start failure to the parent, then exit
        pipe.send(("error", type(exc).__name__, str(exc)))
        pipe.close()
        return
    pipe.send(("ready", coord.address, os.getpid()))

    def watch_parent() -> None:
        try:
            pipe.recv()  # "stop", or EOFError when the parent is gone
        except (EOFError, OSError):
            pass
        coord.stop()

    signal.signal(signal.SIGTERM, lambda *_: coord.stop())
    threading.Thread(target=watch_parent, daemon=True).start()
    coord.serve_forever()


class SpawnedCoordinator:
    """Handle on a coordinator process started by :meth:`Coordinator.spawn`.

    Attributes: ``address`` (socket path), ``pid``, ``process``.
    """

    def __init__(self, process, pipe, address: str, pid: int):
        self.process = process
        self._pipe = pipe
        self.address = address
        self.pid = pid

    @classmethod
    def start(cls, config: PoolConfig, name: Optional[str] = None,
              address: Optional[str] = None, timeout: float = 60.0,
              **options) -> "SpawnedCoordinator":
        ctx = multiprocessing.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(target=_child_main, name="shmkv-coordinator", daemon=True,
                              args=(config.to_wire(), name, address, options, child_end))
        process.start()
        child_end.close()
        if not parent_end.poll(timeout):
            process.kill()
            process.join(5)
            parent_end.close()
            raise CoordinatorTimeout(f"coordinator process did not start within {timeout} s")
        try:
            message = parent_end.recv()
        except EOFError:
            message = ("error", "ShmkvError", f"coordinator process died at start "
                                              f"(exit code {process.exitcode})")
        if message[0] != "ready":
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
            parent_end.close()
            from . import errors
            cls_ = getattr(errors, message[1], ShmkvError)
            if not (isinstance(cls_, type) and issubclass(cls_, ShmkvError)):
                cls_ = ShmkvError
            raise cls_(message[2])
        return cls(process, parent_end, message[1], message[2])

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to stop; kill it if it has not within ``timeout``. Idempotent.

        Also removes the socket file a coordinator killed earlier left behind.
        """
        if self._pipe is not None:
            try:
                self._pipe.send("stop")
            except OSError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        if not self.process.is_alive():
            from .coordinator import remove_stale_socket
            remove_stale_socket(self.address)

    def kill(self) -> None:
        """SIGKILL the coordinator (for crash tests) and reap it. Like a real crash, this
        leaves its socket file; :meth:`stop` or the next coordinator on the address
        removes it."""
        self.process.kill()
        self.process.join(5)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def __enter__(self) -> "SpawnedCoordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
