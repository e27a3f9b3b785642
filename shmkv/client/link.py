"""The client's link to its coordinator: a :class:`Link` that each
:class:`~shmkv.client.client.Client` holds.

Owns the client's socket and what travels on it: connecting, refusing a coordinator of
another uid before a byte is sent (``SO_PEERCRED``), the hello and the descriptors its
answer carries, request ids and one request on the wire at a time (``_lock``), the
coordinator's largest frame (``max_frame``, checked before sending), requests sent
without waiting and what the coordinator refused of them (``flush``,
``posted_errors``), timeouts, and noticing a coordinator that is gone (``check``,
``is_alive``) with the reason it gave. It knows nothing of the client that holds it:
the client hands it the address, the timeout and the uid to trust when it makes it,
the hello's identity (rank, name) when it greets, and closes it when the client
closes. Mapping the pool from the hello's descriptors, the features the coordinator
offers, handles, batches and the per-process registry are ``shmkv.client.client``'s;
frames, ops and error codes are ``shmkv.protocol``'s.

A stream that timed out, broke or sent what cannot be decoded is out of step: the link
marks the coordinator gone and every later request raises ``CoordinatorGone``.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
from typing import Any, Dict, List, Optional, Tuple

from shmkv import protocol
from shmkv.errors import (
    AccessDenied,
    CoordinatorGone,
    CoordinatorTimeout,
    HandleClosed,
    LimitExceeded,
    ProtocolError,
    ShmkvError,
)

_RECV_SIZE = 1 << 18
_MAX_POSTED_ERRORS = 64  # refusals of requests sent without waiting, kept for flush()
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


class Link:
    """One connection to a coordinator, made for a client (see the module).

    Args:
        given_address: the coordinator's socket path as given, to connect to (the
            resolved path may be past the 108 bytes a socket path holds).
        address: the path resolved, for messages.
        timeout: seconds to wait for any answer (the socket's, from :meth:`greet` on).
        trust_uid: a uid besides this process's (and root) that the coordinator may run
            as.

    Attributes: ``address``, ``timeout``, ``pid`` (the process it was made in: it is
    unusable in any other), ``closed`` (by :meth:`close`), ``gone`` (the coordinator hung
    up, or the stream is out of step), ``max_frame`` (the coordinator's largest request,
    from the hello). Nothing is connected until :meth:`greet`.
    """

    max_frame: int  # (set by the hello)

    def __init__(self, given_address: str, address: str, timeout: float, trust_uid: Optional[int]):
        self._given_address = given_address
        self.address = address
        self.timeout = timeout
        self._trust_uid = trust_uid
        self.pid = os.getpid()
        self.closed = False
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._next_id = 1
        self._decoder = protocol.FrameDecoder(protocol.DEFAULT_MAX_FRAME * 4)
        self._pending: list = []
        self._posted: dict = {}  # request id -> op, of requests sent without waiting
        self._posted_errors: list = []
        self._sock: Optional[socket.socket] = None
        self._poll = select.poll()  # (registered with the socket by greet)
        self.gone = False

    # -- the handshake -----------------------------------------------------------------------

    def greet(
        self, fds: List[int], tp_rank: Optional[int], tp_size: Optional[int], name: Optional[str]
    ) -> Dict[str, Any]:
        """Connect, check the peer's uid, send the hello (this process, and the rank and
        name it gives) and return the coordinator's answer. The descriptors that come
        with it are appended to ``fds``, which the caller closes (on failure too).

        Raises:
            CoordinatorGone: nothing serves the address, or it hung up.
            AccessDenied: the coordinator runs as another uid (nothing was sent).
            CoordinatorTimeout: no answer within the timeout.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._given_address)  # (the resolved path may be past 108 bytes)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise CoordinatorGone(f"no coordinator at {self.address} ({exc.strerror})") from None
        self._check_peer(sock)  # before a byte is sent: the hello names this process
        args: Dict[str, Any] = {"version": protocol.PROTOCOL_VERSION, "pid": os.getpid()}
        if tp_rank is not None:
            args.update(tp_rank=tp_rank, tp_size=tp_size)
        if name is not None:
            args["name"] = name
        try:
            sock.sendall(protocol.encode_request(0, "hello", args))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the hello arrived: the reason waits below, to be read
        response = None
        try:
            while response is None:
                data, got, _flags, _addr = socket.recv_fds(sock, _RECV_SIZE, 4)
                fds += got
                if not data:
                    raise CoordinatorGone(
                        f"coordinator at {self.address} closed the connection during the handshake"
                    )
                for obj in self._decoder.feed(data):
                    response = protocol.parse_response(obj)
                    break
        except socket.timeout:
            raise CoordinatorTimeout(
                f"handshake with {self.address} timed out after {self.timeout} s"
            ) from None
        except ConnectionResetError:
            raise CoordinatorGone(
                f"coordinator at {self.address} reset the connection during the handshake"
            ) from None
        hello = response.unwrap()
        # The largest request the coordinator reads: a larger one is split or refused
        # here, before anything is sent.
        self.max_frame = int(hello.get("max_frame", protocol.DEFAULT_MAX_FRAME))
        self._poll.register(sock, select.POLLHUP | select.POLLERR)
        return hello

    def _check_peer(self, sock: socket.socket) -> None:
        """Refuse a coordinator that runs as another uid (``SO_PEERCRED``, the uid the
        listener was created under), unless it is ``trust_uid`` or root (which can read
        this user's memory anyway). Whoever serves the socket gets every K/V this
        client writes, so a socket planted by another user must not be used."""
        _pid, uid, _gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid not in (os.getuid(), 0, self._trust_uid):
            raise AccessDenied(
                f"the coordinator at {self.address} runs as uid {uid}, not as this user "
                f"(uid {os.getuid()}); nothing was sent. Pass connect(..., trust_uid={uid}) "
                "if that user is meant to hold this process's K/V"
            )

    # -- liveness ----------------------------------------------------------------------------

    def _hung_up(self) -> bool:
        # A poll object may not be polled by two threads at once; the lock is uncontended
        # in the common one-thread case.
        with self._poll_lock:
            if self._poll.poll(0):
                self.gone = True
        return self.gone

    def is_alive(self) -> bool:
        """False once the coordinator has hung up or this link was closed (no round trip)."""
        if self.closed or self.gone:
            return False
        return not self._hung_up()

    def check(self) -> None:
        """Raise ``HandleClosed`` or ``CoordinatorGone`` unless the link is usable."""
        if self.closed:
            raise HandleClosed("client is closed")
        if self.gone or (os.getpid() != self.pid) or self._hung_up():
            raise CoordinatorGone(self._gone_message())

    def close(self) -> None:
        """Close the socket (the coordinator then drops what its client held); later
        requests raise ``HandleClosed``. Idempotent."""
        self.closed = True
        if self._sock is not None:
            self._sock.close()

    def _gone_message(self) -> str:
        if os.getpid() != self.pid:
            return (
                "this client was made in another process (fork); connect again in this "
                "process (use the spawn start method)"
            )
        return f"the coordinator at {self.address} is gone; its handles are no longer valid"

    # -- requests ----------------------------------------------------------------------------

    def exchange(self, op: str, args: dict, fds: Optional[List[int]] = None):
        """Send one request and wait for its result (raises the mapped error). With
        ``fds``, the descriptors the answer carries are appended to it (the caller closes
        them), the ones that came before an error too."""
        self.check()
        sock = self._sock
        assert sock is not None  # (connected by the handshake, never unset)
        with self._lock:
            try:
                request_id = self._send(op, args)
                while True:
                    while self._pending:
                        response = protocol.parse_response(self._pending.pop(0))
                        if response.request_id == request_id:
                            return response.unwrap()
                        if response.request_id == -1:  # the coordinator dropped us
                            self.gone = True
                            response.unwrap()
                        if self._posted:
                            self._took_posted(response)
                    if fds is None:
                        data = sock.recv(_RECV_SIZE)
                    else:
                        data, got, _flags, _addr = socket.recv_fds(sock, _RECV_SIZE, 4)
                        fds += got
                    if not data:
                        self.gone = True
                        raise CoordinatorGone(self._gone_message())
                    self._pending.extend(self._decoder.feed(data))
            except socket.timeout:
                self.gone = True  # the stream is out of step now; stop using it
                raise CoordinatorTimeout(f"{op} got no answer within {self.timeout} s") from None
            except ProtocolError:
                self.gone = True  # an undecodable answer: the stream cannot be trusted
                raise
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                self.gone = True
                raise self._drop_reason() from None

    def post(self, op: str, **args) -> None:
        """Send a request without waiting for its answer. The coordinator serves it
        before any later request of this link; :meth:`exchange` takes its answer on the
        way, and :meth:`flush` raises what it refused."""
        self.check()
        with self._lock:
            try:
                self._posted[self._send(op, args)] = op
            except socket.timeout:
                self.gone = True  # part of a frame may be out: the stream is out of step
                raise CoordinatorTimeout(
                    f"{op} could not be sent within {self.timeout} s"
                ) from None
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                self.gone = True
                raise self._drop_reason() from None

    def _send(self, op: str, args: dict) -> int:
        """Send one request (holding ``_lock``); returns its id.

        Raises:
            LimitExceeded: the request is larger than the coordinator reads (nothing sent).
        """
        request_id = self._next_id
        frame = protocol.encode_request(request_id, op, args)
        if len(frame) - protocol.HEADER_SIZE > self.max_frame:
            raise LimitExceeded(
                f"{op} request of {len(frame) - protocol.HEADER_SIZE} bytes "
                f"exceeds the coordinator's maximum frame of {self.max_frame} "
                "bytes (nothing was sent); split it, or start the coordinator "
                "with a larger max_frame"
            )
        self._next_id += 1
        assert self._sock is not None  # (connected by the handshake, never unset)
        self._sock.sendall(frame)
        return request_id

    # -- requests sent without waiting -------------------------------------------------------

    def _took_posted(self, response) -> None:
        """(Holding ``_lock``.) The answer to a request sent without waiting."""
        op = self._posted.pop(response.request_id, None)
        if op is not None and response.code and len(self._posted_errors) < _MAX_POSTED_ERRORS:
            self._posted_errors.append(
                (op, protocol.exception_for(response.code, response.message))
            )

    def posted_errors(self) -> List[Tuple[str, ShmkvError]]:
        """The ``(op, error)`` of each request sent without waiting that the coordinator
        refused, as answers came in so far (never waits; the list is emptied). At most
        the first 64 are kept between two calls."""
        with self._lock:
            errors, self._posted_errors = self._posted_errors, []
        return errors

    def flush(self) -> None:
        """Wait until the coordinator has served every request this link sent without
        waiting (:meth:`post`); raise the first one it refused.

        Raises:
            ShmkvError: what the coordinator answered a request sent without waiting.
        """
        if self._posted:
            self.exchange("ping", {})  # answered after everything sent before it
        with self._lock:
            errors, self._posted_errors = self._posted_errors, []
        if errors:
            op, exc = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise type(exc)(f"{op} (sent without waiting): {exc}{more}") from exc

    def _drop_reason(self) -> Exception:
        """Why the connection broke: the coordinator's last error frame if it sent one
        before closing (an oversized request, say), else ``CoordinatorGone``."""
        frames = list(self._pending)
        sock = self._sock
        assert sock is not None  # (connected by the handshake, never unset)
        try:
            sock.setblocking(False)
            while True:
                data = sock.recv(_RECV_SIZE)
                if not data:
                    break
                frames.extend(self._decoder.feed(data))
        except (OSError, ProtocolError):
            pass
        for obj in frames:
            try:
                response = protocol.parse_response(obj)
            except ProtocolError:
                continue
            if response.request_id == -1 and response.code:
                return protocol.exception_for(response.code, response.message)
        return CoordinatorGone(self._gone_message())
