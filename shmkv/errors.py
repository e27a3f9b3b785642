"""Exception classes of shmkv.

Owns the exception hierarchy only. The wire codes that name these classes live in
``shmkv.protocol`` (one table for every message type and error code).

Every error derives from :class:`ShmkvError`. Argument errors also derive from the
built-in exception a Python user expects (``ValueError``, ``IndexError``,
``TypeError``), so ``except ValueError`` keeps working around shmkv calls.
"""


class ShmkvError(Exception):
    """Base class of every error raised by shmkv."""


class PoolExhausted(ShmkvError):
    """The pool has too few free (or evictable) blocks for the request.

    Nothing was allocated or changed. Free handles, or raise ``num_blocks``.
    """


class UnknownCache(ShmkvError, KeyError):
    """The cache id does not exist, or this connection holds no reference to it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CoordinatorGone(ShmkvError, ConnectionError):
    """The coordinator process is gone; handles of this client are no longer valid."""


class CoordinatorTimeout(ShmkvError, TimeoutError):
    """The coordinator did not answer within the client's timeout."""


class ProtocolError(ShmkvError):
    """A frame or message broke the wire protocol.

    ``remote`` is True when the peer sent the bad data, False when this side did.
    """

    def __init__(self, message: str, remote: bool = True):
        super().__init__(message)
        self.remote = remote


class HandleClosed(ShmkvError, ValueError):
    """The handle was closed (or its client was closed) and can no longer be used."""


class InvalidArgument(ShmkvError, ValueError):
    """An argument has a wrong value: a size, a shape, a dtype, a device, a range."""


class OutOfRange(ShmkvError, IndexError):
    """A layer index or token position lies outside what the handle has reserved."""


class WrongType(ShmkvError, TypeError):
    """An argument has the wrong type (for example a list where a tensor is expected)."""


class HandoffError(ShmkvError, ValueError):
    """A hand-off token is malformed, forged, already used, or expired."""


class LimitExceeded(ShmkvError):
    """A configured limit (connections, frame size, outstanding hand-offs) was hit."""


class AccessDenied(ShmkvError, PermissionError):
    """The peer is not allowed to use this coordinator (another user)."""


class LayoutMismatch(ShmkvError):
    """The pool's layout fingerprint does not match what this client expects."""


class StaleStep(ShmkvError):
    """A step (or a step descriptor) no longer matches its sequences: one was closed,
    or a block it writes was shared or published since the step was made. Make a new
    step; nothing was written."""


class NotSettled(ShmkvError):
    """A lower tier is still copying blocks of the sequence into the pool (an allocation
    answered early, ``allocate(..., wait=False)``): until that promotion has settled only
    the sequence's holders use it. Raised by a view that holds no reference and cannot
    wait (:meth:`~shmkv.client.client.Client.peek`); a holder's ``handle.settle()`` waits for
    the blocks, after which the view may be made again."""
